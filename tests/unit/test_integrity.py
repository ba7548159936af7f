"""Checkpoint digests (toolkit/runtime/faults/integrity.py), one process: taken while writing, equal to the file's,
and a flipped byte, a truncated or a missing file each named by resume.check_intact with the way back."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.runtime.faults import integrity, resume
from toolkit.runtime.faults.checkpoint import COMPLETE, mark_complete


class _TorchEngine:  # the part of DeepSpeed's TorchCheckpointEngine the wrapper uses
    zipfile_serialization = True


def _save_checkpoint(root: Path, step: int) -> Path:
    ckpt = root / f"global_step{step}"
    ckpt.mkdir(parents=True)
    writer = integrity.DigestingEngine(_TorchEngine())
    writer.start()
    for rank in range(2):
        writer.save({"w": torch.arange(1000, dtype=torch.float32) * (rank + step), "step": step},
                    str(ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    (ckpt / "extra.json").write_text("{}")  # a file DeepSpeed did not write: digested by reading
    fields = integrity.finish_save(writer, ckpt, 1, "test", 1, "note")
    mark_complete(ckpt, step, fields)
    return ckpt


def test_digest_taken_while_writing_is_the_files(tmp_path: Path) -> None:
    ckpt = _save_checkpoint(tmp_path, 2)
    record = json.loads((ckpt / COMPLETE).read_text())
    assert record["digest"] == "xxh3_128" and set(record["files"]) == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "extra.json"}
    for rel, (size, digest) in record["files"].items():
        assert list(integrity.file_digest(ckpt / rel)) == [size, digest], rel
    assert record["bytes"] == sum(s for s, _ in record["files"].values())
    loaded = torch.load(ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32) * 3)
    assert integrity.verify(ckpt, record)[0] == []


def test_a_flipped_byte_truncation_or_missing_file_is_named_with_the_way_back(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save_checkpoint(root, 2)
    newest = _save_checkpoint(root, 4)
    shard = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    ckpt = resume.find(tmp_path, "raw", "latest")
    line = resume.check_intact(ckpt, "raw")
    assert line is not None and "\n" not in line
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt does not match the digest" in line, line
    assert line.endswith("the previous complete checkpoint is global_step2: resume from it with "
                         "train.resume=global_step2"), line
    shard.write_bytes(bytes(data[:100]))
    (newest / "extra.json").unlink()
    line = resume.check_intact(ckpt, "raw")
    assert "extra.json is missing" in line and "(and 1 more file(s))" in line, line
    assert "is 100 bytes" in integrity.verify(newest, ckpt.record)[0][1]
    assert resume.check_intact(resume.find(tmp_path, "raw", "global_step2"), "raw") is None
    (root / "global_step2" / "extra.json").write_text("{} ")
    assert "no earlier complete checkpoint" in resume.check_intact(resume.find(tmp_path, "raw", "global_step2"), "raw")


def test_verification_reads_are_spread_by_size() -> None:
    files = {f"f{i}": [size, "x"] for i, size in enumerate([100, 90, 50, 40, 10, 5])}
    shares = [integrity._share(files, 3, r) for r in range(3)]
    assert sorted(f for s in shares for f in s) == sorted(files)
    loads = [sum(files[f][0] for f in s) for s in shares]
    assert max(loads) - min(loads) <= 50, loads
