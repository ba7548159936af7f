"""Pure parts of resume (toolkit/runtime/faults/resume.py): finding the checkpoint, its rank count, the accumulation that
keeps its global batch, and the DeepSpeed dict that loads a universal checkpoint. The real conversions and
loads on 1, 2 and 4 ranks are tests/dist/test_resume_world.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.faults.checkpoint import mark_complete, prune
from toolkit.runtime.faults.resume import Checkpoint, find, reshard_for, tolerance, universal_config


def _raw_checkpoint(root: Path, step: int, ranks: int, complete: bool = True, **record: object) -> Path:
    d = root / "checkpoints" / f"global_step{step}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").touch()
    for r in range(ranks):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
    if complete:
        mark_complete(d, step, dict(record))
    return d


def test_latest_is_the_newest_complete_checkpoint_and_counts_its_ranks(tmp_path: Path) -> None:
    _raw_checkpoint(tmp_path, 2, ranks=2, global_batch=8)
    _raw_checkpoint(tmp_path, 4, ranks=4, global_batch=8)
    _raw_checkpoint(tmp_path, 6, ranks=2, complete=False)  # a save killed half-way
    ck = find(tmp_path, "raw", "latest")
    assert (ck.step, ck.world_size, ck.global_batch(0)) == (4, 4, 8)
    assert find(tmp_path, "raw", "global_step2").world_size == 2


def test_trainer_checkpoints_hold_the_deepspeed_tag_inside(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "checkpoint-3"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()
    mark_complete(ckpt, 3)
    ck = find(tmp_path, "trainer", "latest")
    assert ck.dir == ckpt and ck.tag_dir == ckpt / "global_step3" and ck.world_size == 1


def test_missing_checkpoints_say_where_they_looked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        find(tmp_path, "raw", "latest")
    with pytest.raises(FileNotFoundError, match="global_step9"):
        find(tmp_path, "raw", "global_step9")


def test_zero0_checkpoints_and_the_same_rank_count_load_as_they_are(tmp_path: Path) -> None:
    same = Checkpoint(_raw_checkpoint(tmp_path, 1, ranks=2), _raw_checkpoint(tmp_path / "b", 1, ranks=2), 1)
    assert reshard_for(same, 2, 2, 2) is None
    zero0 = tmp_path / "z0"
    zero0.mkdir()
    (zero0 / "mp_rank_00_model_states.pt").touch()  # ZeRO-0: the optimizer state is whole on every rank
    assert reshard_for(Checkpoint(zero0, zero0, 1), 2, 2, 4) is None


def test_accumulation_absorbs_the_new_rank_count(tmp_path: Path) -> None:
    d = _raw_checkpoint(tmp_path, 4, ranks=2, global_batch=16)
    ck = find(tmp_path, "raw", "latest")
    assert [reshard_for(ck, 2, 4, w).grad_accum for w in (1, 4, 8)] == [8, 2, 1]
    with pytest.raises(ConfigError, match=r"use train\.micro_batch_size=2$"):
        reshard_for(ck, 4, 2, 8)  # 16 over 8 ranks is 2 per rank: micro 4 cannot
    with pytest.raises(ConfigError, match="a rank count that divides 16"):
        reshard_for(ck, 2, 4, 3)
    # an older marker without the global batch: assume the same command as before
    (d / "complete.json").write_text(json.dumps({"step": 4}))
    assert reshard_for(find(tmp_path, "raw", "latest"), 2, 4, 1).grad_accum == 8


def test_universal_config_keeps_the_rest_of_the_dict() -> None:
    ds = {"zero_optimization": {"stage": 2}, "checkpoint": {"tag_validation": "warn"}}
    out = universal_config(ds)
    assert out["checkpoint"] == {"tag_validation": "warn", "load_universal": True}
    assert out["zero_optimization"] == {"stage": 2} and "load_universal" not in ds["checkpoint"]
    assert tolerance("fp32") == 1e-5 and tolerance("bf16") > tolerance("fp32")


def test_prune_takes_a_checkpoints_universal_conversion_with_it(tmp_path: Path) -> None:
    for step in (2, 4):
        _raw_checkpoint(tmp_path, step, ranks=2)
    (tmp_path / "checkpoints" / "global_step2_universal").mkdir()
    removed = prune(tmp_path / "checkpoints", "global_step", keep=1)
    assert {d.name for d in removed} == {"global_step2", "global_step2_universal"}
    assert sorted(d.name for d in (tmp_path / "checkpoints").iterdir()) == ["global_step4"]


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path: Path) -> None:
    from toolkit.runtime.faults.resume import set_aside_newer

    for step in (2, 4, 6):
        _raw_checkpoint(tmp_path, step, ranks=2)
    _raw_checkpoint(tmp_path, 8, ranks=2, complete=False)  # a partial save stays for prune to handle
    (tmp_path / "checkpoints" / "global_step6_universal").mkdir()
    note = set_aside_newer(find(tmp_path, "raw", "global_step4"), "raw")
    assert note and "1 checkpoint(s) newer than global_step4" in note
    (aside,) = (tmp_path / "checkpoints").glob("abandoned-*")
    assert sorted(d.name for d in aside.iterdir()) == ["global_step6", "global_step6_universal"]  # kept, not deleted
    assert find(tmp_path, "raw", "latest").step == 4  # what the resumed run writes next now wins
    assert (tmp_path / "checkpoints" / "global_step8").is_dir()


def test_a_save_into_a_stale_directory_starts_empty(tmp_path: Path) -> None:
    from toolkit.runtime.faults.checkpoint import clear_stale

    stale = _raw_checkpoint(tmp_path, 4, ranks=4)  # a killed 4-rank run's files, marked complete
    (stale.with_name("global_step4_universal")).mkdir()
    clear_stale(stale)
    assert not stale.exists() and not stale.with_name("global_step4_universal").exists()


def test_resume_keeps_the_checkpoints_global_batch(tmp_path: Path) -> None:
    from toolkit.config.schema import load_config
    from toolkit.runtime.spec import _resume

    _raw_checkpoint(tmp_path, 4, ranks=2, global_batch=8)
    cfg = load_config(None, ["train.path=raw", "train.resume=latest", f"train.run_dir={tmp_path}",
                             "train.micro_batch_size=2", "train.grad_accum=4"])  # 16 on 2 ranks
    with pytest.raises(ConfigError, match=r"trained a global batch of 8.*= 16; keep 8"):
        _resume(cfg, 2, {})
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(ConfigError, match="NVMe"):
        _resume(cfg, 1, nvme)


def test_the_fixed_batch_is_bounded_whatever_the_training_length() -> None:
    """The save's proof batch: a 384K-token row's no-grad forward would not fit where its training step does."""
    from toolkit.runtime.data.batches import Collator
    from toolkit.runtime.faults.resume import FIXED_TOKENS, fixed_batch

    n = FIXED_TOKENS + 100
    plain = [{"input_ids": list(range(n)), "labels": list(range(n))} for _ in range(3)]
    b = fixed_batch(plain, Collator(pad_id=0))
    assert tuple(b["input_ids"].shape) == (2, FIXED_TOKENS) and b["labels"][0, -1] == FIXED_TOKENS - 1
    packed = [{"input_ids": list(range(n)), "labels": list(range(n)), "seq_lens": [1000, 1000, n - 2000]}] * 2
    b = fixed_batch(packed, Collator(pad_id=0))
    assert tuple(b["input_ids"].shape) == (2, FIXED_TOKENS)
    assert b["position_ids"][0, 2000:].tolist() == list(range(FIXED_TOKENS - 2000))  # the third document, cut
    short = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 2
    assert fixed_batch(short, Collator(pad_id=0))["input_ids"].shape[1] == 3
    # a long prompt (synthetic rows mask their first quarter: all of the window from 8,192 tokens on) scores every
    # token of the window instead of none (a loss over no label is NaN: what run s57's checkpoint recorded)
    masked = [{"input_ids": list(range(4 * n)), "labels": [-100] * n + list(range(n, 4 * n))}] * 2
    b = fixed_batch(masked, Collator(pad_id=0))
    assert b["labels"][0].tolist() == list(range(FIXED_TOKENS))


def test_a_checkpoint_whose_proof_loss_was_not_finite_resumes_unverified(tmp_path: Path, capsys,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN at the save proves nothing either way (seen on a GPU: the 8B shape at 384K, bench/results/long_seq):
    the resume says it is not verified instead of refusing the weights."""
    import torch

    from toolkit.runtime.faults.resume import RESUMES, batch_digest, verify

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    ckpt = Checkpoint(tmp_path, tmp_path, 1, {"fixed_batch_loss": float("nan"), "fixed_batch": batch_digest(batch)})
    verify(object(), batch, ckpt, tmp_path, "bf16", 1, 1, None)  # the model is never called
    assert "not verified: the fixed-batch loss at the save was not finite" in capsys.readouterr().out
    assert json.loads((tmp_path / RESUMES).read_text())["not_verified"].startswith("the fixed-batch loss")
