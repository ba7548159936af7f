"""metrics.report_to without a launch: the config forms it accepts (and metrics.tensorboard=false as
before), a missing package as one line, and the per-rank memory that rides on the log line's all-reduce.
tests/dist/test_trackers.py reads back what wandb and mlflow got from real 2-rank runs."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.observe import trackers

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("overrides", "report_to"), [
    ([], ["tensorboard"]),
    (["metrics.report_to=wandb"], ["wandb"]),  # HF's report_to="wandb" spelling
    (["metrics.report_to=[tensorboard,mlflow]"], ["tensorboard", "mlflow"]),
    (["metrics.report_to=tensorboard,wandb"], ["tensorboard", "wandb"]),
    (["metrics.report_to=none"], []),
    (["metrics.tensorboard=false"], []),  # the older switch still turns TensorBoard off
    (["metrics.report_to=[tensorboard,wandb]", "metrics.tensorboard=false"], ["wandb"]),
])
def test_report_to_forms(overrides: list[str], report_to: list[str]) -> None:
    m = load_config(None, overrides).metrics
    assert m.report_to == report_to and m.tensorboard == ("tensorboard" in report_to)


def test_unknown_tracker_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
        load_config(None, ["metrics.report_to=[wandb,neptune]"])


def test_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError) as e:
        trackers.check(["tensorboard", "mlflow"])
    assert str(e.value) == ("metrics.report_to has mlflow, but the mlflow package is not installed: "
                            "pip install mlflow-skinny (or mlflow)")
    trackers.check(["tensorboard"])  # TensorBoard is a dependency: nothing to check


def test_training_entry_says_it_in_one_line_before_starting() -> None:
    # wandb hidden from this process only; the entry must stop before any process group or model work
    code = ("import importlib.util as u\nreal = u.find_spec\n"
            "u.find_spec = lambda n, *a: None if n == 'wandb' else real(n, *a)\n"
            "from toolkit import train\nraise SystemExit(train.main(['metrics.report_to=[tensorboard,wandb]']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("error: metrics.report_to has wandb, but the wandb package is not "
                                                 "installed: pip install wandb")
    assert "Traceback" not in p.stderr


def test_memory_of_every_rank_survives_the_sum() -> None:
    world = 3
    readings = [{"allocated_gib": 1.5, "peak_allocated_gib": 2.0, "nvml_used_gib": None, "host_rss_gib": 0.25 * r}
                for r in range(world)]
    vectors = [trackers.memory_slots(readings[r], r, world) for r in range(world)]
    summed = [sum(col) for col in zip(*vectors, strict=True)]  # what the all-reduce does
    back = trackers.memory_from_slots(summed, world)
    for r in range(world):
        assert back[r] == readings[r] | {"nvml_used_gib": None}
    assert trackers.memory_slots(None, 0, world) == [] and trackers.memory_from_slots([], world) == {}


def test_scalars_use_tensorboards_tags_and_leave_nulls_out() -> None:
    rec = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 100.0, "mfu": None,
           "samples_per_s": 4.0, "step_time_s": 0.5, "elapsed_s": 9.0}
    out = trackers.scalars(rec, {1: {"host_rss_gib": 0.5, "allocated_gib": None}})
    assert out["train/loss"] == 2.5 and out["train/tokens_per_s"] == 100.0
    assert "train/grad_norm" not in out and "train/mfu" not in out
    assert out["memory/rank1/host_rss_gib"] == 0.5 and "memory/rank1/allocated_gib" not in out
    assert not any(isinstance(v, float) and math.isnan(v) for v in out.values())
