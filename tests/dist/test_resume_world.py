"""Resume on another number of ranks (issue 12, item 5): a run checkpointed on 2 CPU ranks continues on
1 and on 4, on both paths and at ZeRO-2 and ZeRO-3, through DeepSpeed's universal checkpoint.

One uninterrupted 2-rank run is the reference. Each case stops a 2-rank run at step 4 (with a checkpoint),
copies the run directory once per target rank count, and resumes it there. What must hold:
- the loss on a fixed batch right after the load equals the one at the save within 1e-5 (fp32);
- the global batch stays 8 (micro 2): grad_accum 4 on 1 rank, 1 on 4 ranks;
- steps 5..8 follow the reference: the same learning rates (the schedule continues) and losses within
  1e-4 (the batch order continues; only the order of fp32 reductions differs between rank counts);
- the records written before the resume are untouched: metrics.jsonl's first four lines are the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _jsonl import lines
from _net import free_port

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("train.max_steps=8", "train.micro_batch_size=2", "train.precision=fp32", "train.export=false",
          "memory.every=0", "metrics.tensorboard=false")


def _train(ranks: int, run_dir: Path, ds: str, *extra: str) -> None:
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), "toolkit/train.py",
           "--ds", f"ds_configs/{ds}.json", f"train.run_dir={run_dir}", *COMMON, *extra]
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    log = run_dir.with_name(f"{run_dir.name}.log")
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=400).returncode
    assert rc == 0, log.read_text()[-5000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    run = tmp_path_factory.mktemp("ref") / "run"
    _train(2, run, "zero2", "train.path=raw", "train.grad_accum=2")
    return {m["step"]: m for m in lines(run / "metrics.jsonl")}


@pytest.mark.dist
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("path", "ds"), [("raw", "zero2"), ("trainer", "zero2"), ("raw", "zero3")])
def test_a_two_rank_checkpoint_resumes_on_one_and_four_ranks(path: str, ds: str, reference: dict[int, dict],
                                                            tmp_path: Path) -> None:
    stopped = tmp_path / "two"
    _train(2, stopped, ds, f"train.path={path}", "train.grad_accum=2", "train.stop_after=4")
    before = (stopped / "metrics.jsonl").read_bytes()
    assert len(before.splitlines()) == 4
    for ranks, accum in ((1, 4), (4, 1)):
        run = tmp_path / f"on{ranks}"
        shutil.copytree(stopped, run)
        # the command's grad_accum=2 is what the user ran before; the checkpoint's global batch wins
        _train(ranks, run, ds, f"train.path={path}", "train.grad_accum=2", "train.resume=latest")
        (entry,) = lines(run / "resumes.jsonl")
        assert entry["saved_world_size"] == 2 and entry["world_size"] == ranks and entry["grad_accum"] == accum
        assert entry["universal"] == "global_step4_universal", entry
        saved, loaded = entry["fixed_batch_loss_saved"], entry["fixed_batch_loss_loaded"]
        assert saved is not None and abs(loaded - saved) <= 1e-5 * max(1.0, abs(saved)), entry
        assert f"grad_accum: {accum}" in (run / "config.yaml").read_text()
        assert json.loads((run / "status.json").read_text())["status"] == "completed"
        metrics = (run / "metrics.jsonl").read_bytes()
        assert metrics.startswith(before), "the records of the run before the resume changed"
        after = {m["step"]: m for m in lines(run / "metrics.jsonl")}
        assert sorted(after) == list(range(1, 9))
        for step in range(5, 9):
            ref, got = reference[step], after[step]
            assert got["lr"] == pytest.approx(ref["lr"], rel=1e-9, abs=1e-12), (ranks, step, got, ref)
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (ranks, step, got, ref)
