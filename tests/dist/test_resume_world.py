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
import shutil
from pathlib import Path

import pytest
from _jsonl import lines
from _launch import Runs, launch

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("train.max_steps=8", "train.micro_batch_size=2", "train.precision=fp32", "train.export=false",
          "memory.every=0", "metrics.tensorboard=false")


CASES = [("raw", "zero2"), ("trainer", "zero2"), ("raw", "zero3")]
# bf16 master weights and states at ZeRO-2, the masters sharing the weights' storage (runtime/low_precision.py): the
# universal checkpoint must load into the shared storage
BF16 = ("raw", "bf16states")


def _argv(run_dir: Path, ds: str, *extra: str) -> list[str]:
    ds_file = run_dir.parents[1] / "bf16states.json" if ds == BF16[1] else ROOT / "ds_configs" / f"{ds}.json"
    bf16 = ("train.precision=bf16",) if ds == BF16[1] else ()
    return ["--ds", str(ds_file), f"train.run_dir={run_dir}", *COMMON, *bf16, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three launches in all (tests/dist/_multi_train.py), not three per case: on 2 ranks the uninterrupted
    reference and each case's run stopped at step 4; each stopped run directory copied once per target rank count;
    then every case's resume on 1 rank in one launch, and on 4 ranks in another."""
    from toolkit.config import ds_config as dc

    tmp = Runs(tmp_path_factory.mktemp("resume_world"))
    dc.write_config(dc.gen_config(2, optimizer_states="bf16", precision="bf16"), tmp / "bf16states.json")
    cases = [*CASES, BF16]
    two = [{"name": "reference", "argv": _argv(tmp / "reference", "zero2", "train.path=raw", "train.grad_accum=2")}]
    two += [{"name": f"{path}-{ds}", "argv": _argv(tmp / f"{path}-{ds}" / "two", ds, f"train.path={path}",
                                                   "train.grad_accum=2", "train.stop_after=4")} for path, ds in cases]
    launch(tmp, two, gpus=2, name="two", timeout=900)
    for path, ds in cases:
        for ranks in (1, 4):
            shutil.copytree(tmp / f"{path}-{ds}" / "two", tmp / f"{path}-{ds}" / f"on{ranks}")
    for ranks in (1, 4):
        # the command's grad_accum=2 is what the user ran before; the checkpoint's global batch wins
        launch(tmp, [{"name": f"{path}-{ds}-on{ranks}",
                      "argv": _argv(tmp / f"{path}-{ds}" / f"on{ranks}", ds, f"train.path={path}",
                                    "train.grad_accum=2", "train.resume=latest")} for path, ds in cases],
               gpus=ranks, name=f"on{ranks}", timeout=900)
    return tmp


@pytest.mark.dist
@pytest.mark.timeout(2400)
@pytest.mark.parametrize(("path", "ds"), CASES)
def test_a_two_rank_checkpoint_resumes_on_one_and_four_ranks(path: str, ds: str, runs: Path) -> None:
    reference = {m["step"]: m for m in lines(runs / "reference" / "metrics.jsonl")}
    stopped = runs / f"{path}-{ds}" / "two"
    before = (stopped / "metrics.jsonl").read_bytes()
    assert len(before.splitlines()) == 4
    for ranks, accum in ((1, 4), (4, 1)):
        run = runs / f"{path}-{ds}" / f"on{ranks}"
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


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bf16_masters_sharing_the_weights_resume_on_one_and_four_ranks(runs: Path) -> None:
    """The universal checkpoint loads into the masters where they share the weights' storage: the fixed batch's loss
    right after the load is the one at the save (the weights came back), and the run ends."""
    path, ds = BF16
    assert "masters share the weights' storage" in (runs / "two.log").read_text()
    for ranks in (1, 4):
        run = runs / f"{path}-{ds}" / f"on{ranks}"
        (entry,) = lines(run / "resumes.jsonl")
        assert entry["universal"] == "global_step4_universal", entry
        saved, loaded = entry["fixed_batch_loss_saved"], entry["fixed_batch_loss_loaded"]
        assert saved is not None and abs(loaded - saved) <= 1e-3 * abs(saved), entry
        assert json.loads((run / "status.json").read_text())["status"] == "completed"
        assert sorted(m["step"] for m in lines(run / "metrics.jsonl")) == list(range(1, 9))
