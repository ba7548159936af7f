"""Muon and bf16 optimizer states on 2 CPU ranks, in one shared launch (configs from `toolkit gen-config`): Muon trains
with the same losses at ZeRO-0, 2 and 3 and on both paths, its loss falls, DeepSpeed's split is recorded, LoRA and
DPO run with it; bf16 master weights and states train on both paths at ZeRO-2 and 3; a gradient clip under Muon at
ZeRO-2 is refused in one line before the engine exists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _launch import launch, run_logs

from tests.dist._jsonl import lines
from toolkit.config import ds_config as dc

pytestmark = pytest.mark.dist
COMMON = ["train.precision=fp32", "memory.every=0", "metrics.tensorboard=false", "train.micro_batch_size=2",
          "train.max_steps=4", "train.export=false"]
# name -> (stage, optimizer, states, path, extra)
RUNS = {
    "muon-z0": (0, "muon", "fp32", "raw", []),
    "muon-z2": (2, "muon", "fp32", "raw", []),
    "muon-z3": (3, "muon", "fp32", "raw", []),
    "muon-z3-trainer": (3, "muon", "fp32", "trainer", []),
    "muon-z2-lora": (2, "muon", "fp32", "raw", ["lora.enabled=true"]),
    "muon-z2-dpo": (2, "muon", "fp32", "raw", ["train.objective=dpo", "lora.enabled=true", "data.seq_len=24"]),
    "bf16-states-z2": (2, "adamw", "bf16", "raw", ["train.precision=bf16"]),
    "bf16-states-z3-trainer": (3, "adamw", "bf16", "trainer", ["train.precision=bf16"]),
    "muon-z2-clipped": (2, "muon", "fp32", "raw", ["train.grad_clip=1.0"]),
}
REFUSED = {"muon-z2-clipped"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("optimizers")
    specs = []
    for name, (stage, optimizer, states, path, extra) in RUNS.items():
        ds = tmp / f"{name}.json"
        dc.write_config(dc.gen_config(stage, optimizer=optimizer, optimizer_states=states, targets=("trainer", "raw")),
                        ds)
        argv = ["--ds", str(ds), *COMMON, f"train.path={path}", f"train.run_dir={tmp / name}", *extra]
        specs.append({"name": name, "argv": argv, "expect_rc": 1 if name in REFUSED else 0})
    launch(tmp, specs, name="optimizers", timeout=1200)
    return tmp, run_logs(tmp / "optimizers.log")


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in lines(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.timeout(1300)
def test_muon_trains_alike_at_every_stage_and_path_and_its_loss_falls(runs: tuple[Path, dict[str, str]]) -> None:
    tmp, logs = runs
    want = _losses(tmp / "muon-z0")
    assert len(want) == 4 and want[-1] < want[0], want
    for name in ("muon-z2", "muon-z3", "muon-z3-trainer"):
        # fp32, no clipping (Muon's default): ZeRO's partitioned Muon is the whole-matrix one
        assert _losses(tmp / name) == pytest.approx(want, abs=1e-4), (name, _losses(tmp / name), want)
        assert "optimizer: Muon: 2-D hidden matrices at lr 0.02" in logs[name], logs[name][-3000:]
    assert "no gradient clipping (DeepSpeed would clip Muon's update at ZeRO-3)" in logs["muon-z3"]
    # DeepSpeed's split, as recorded: the tiny llama's 2 layers x 7 projections to Muon, the rest to Adam
    split = json.loads((tmp / "muon-z3" / "optimizer_groups.json").read_text())
    assert split["muon"]["tensors"] == 14 and split["adam"]["tensors"] > 0, split
    assert not any("embed" in n or "lm_head" in n for n in split["muon"]["examples"]), split
    assert json.loads((tmp / "muon-z2" / "optimizer_groups.json").read_text()) == split


@pytest.mark.timeout(1300)
def test_lora_and_dpo_run_under_muon(runs: tuple[Path, dict[str, str]]) -> None:
    tmp, logs = runs
    lora = json.loads((tmp / "muon-z2-lora" / "optimizer_groups.json").read_text())
    # only the adapters train: their 2-D A and B matrices are Muon's (2 layers x 4 targets x 2), nothing is Adam's
    assert lora["muon"]["tensors"] > 0 and all("lora_" in n for n in lora["muon"]["examples"] if "more" not in n), lora
    assert all(math.isfinite(x) for x in _losses(tmp / "muon-z2-lora"))
    dpo = _losses(tmp / "muon-z2-dpo")
    assert dpo[0] == pytest.approx(math.log(2), abs=1e-4) and all(math.isfinite(x) for x in dpo), dpo


@pytest.mark.timeout(1300)
def test_bf16_master_weights_and_states_train_on_both_paths(runs: tuple[Path, dict[str, str]]) -> None:
    tmp, logs = runs
    for name in ("bf16-states-z2", "bf16-states-z3-trainer"):
        got = _losses(tmp / name)
        assert len(got) == 4 and all(math.isfinite(x) for x in got) and got[-1] < got[0], (name, got)
        assert "AdamW at lr 0.001; bf16 master weights, gradients and states" in logs[name], logs[name][-3000:]


@pytest.mark.timeout(1300)
def test_a_clip_under_muon_at_zero2_is_refused_in_one_line(runs: tuple[Path, dict[str, str]]) -> None:
    tmp, logs = runs
    log = logs["muon-z2-clipped"]
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "train.grad_clip=1.0 with Muon at ZeRO-2" in errors[0], log[-3000:]
    assert not (tmp / "muon-z2-clipped" / "metrics.jsonl").exists()
