"""`toolkit plan -o DIR` end to end on 2 CPU ranks through the real launcher: the written config passes
`toolkit check` and trains via `./launch.sh --plan DIR`; the run directory holds the plan and every
rank's measured breakdown, and `toolkit report` puts them side by side. Then bench/plan_calibrate.py's
CPU smoke modes, so a device run of it does not fail on something a CPU could have caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _net import free_port

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    return env | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}


def _toolkit(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit", *argv], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.timeout(600)
def test_plan_dir_passes_check_and_trains_on_two_cpu_ranks(tmp_path: Path) -> None:
    plan_dir, run_dir = tmp_path / "plan", tmp_path / "run"
    made = _toolkit("plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "8", "-o", str(plan_dir))
    assert made.returncode == 0, made.stderr
    cfg = yaml.safe_load((plan_dir / "train.yaml").read_text())
    micro, accum = cfg["train"]["micro_batch_size"], cfg["train"]["grad_accum"]
    assert micro * accum * 2 == 8
    checked = _toolkit("check", str(plan_dir / "ds_config.json"), "--world-size", "2", "--micro-batch", str(micro),
                       "--grad-accum", str(accum))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    launch = [str(ROOT / "launch.sh"), "--plan", str(plan_dir), "--master-port", str(free_port()), "--",
              "train.max_steps=3", f"train.run_dir={run_dir}", "train.export=false", "metrics.tensorboard=false"]
    ran = subprocess.run(launch, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=500)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == micro and ds["gradient_accumulation_steps"] == accum
    assert (run_dir / "plan.json").read_text() == (plan_dir / "plan.json").read_text()
    for rank in (0, 1):
        b = json.loads((run_dir / "memory" / f"breakdown_rank{rank}.json").read_text())
        host = b["host"]  # CPU ranks: the model's tensors live on the host
        assert host["params_gib"] > 0 and host["optimizer_gib"] > 0 and host["peak_rss_gib"] > 0, b

    report = _toolkit("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert "Predicted (toolkit plan) vs measured, per rank" in report.stdout
    assert "host RSS, peak" in report.stdout and "differs from the plan" not in report.stdout


@pytest.mark.timeout(900)
def test_plan_calibrate_smoke_runs_every_mode(tmp_path: Path) -> None:
    env = _env()
    cal = subprocess.run([sys.executable, "bench/plan_calibrate.py", "run", "--smoke", "--out", str(tmp_path / "cal"),
                          "--port", str(free_port(span=4))], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert cal.returncode == 0, cal.stdout[-3000:] + cal.stderr[-3000:]
    result = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert [r["config"]["name"] for r in result["rows"]] == ["tiny-z2", "tiny-z3all"]
    for row in result["rows"]:
        assert row["rc"] == 0 and row["host_error"] is not None and row["predicted"]["peak_allocated_gib"] > 0
        assert len(row["measured"]["per_rank"]) == 2 and len(row["measured"]["losses"]) == 3
    md = (tmp_path / "cal" / "calibration.md").read_text()
    assert "| tiny-z3all | 2 | 3 | all |" in md and "Host RSS: worst error" in md
    assert "Predicted (toolkit plan)" in subprocess.run(
        [sys.executable, "-m", "toolkit", "report", str(tmp_path / "cal" / "runs" / "tiny-z2")], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120).stdout

    big = subprocess.run([sys.executable, "bench/plan_calibrate.py", "bigrun", "--smoke", "--model", "tiny", "--seq", "64",
                          "--global-batch", "4", "--steps", "3", "--gpu-mem", "80", "--host-mem", "64",
                          "--port", str(free_port()), "--out", str(tmp_path / "big")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert big.returncode == 0, big.stdout[-3000:] + big.stderr[-3000:]
    result = json.loads((tmp_path / "big" / "bigrun.json").read_text())
    assert result["rc"] == 0 and len(result["measured"]["losses"]) == 3 and result["chosen"]["fits"]
