"""The speed benchmark's harness on 2 CPU ranks (tiny model): every variant runs through the real
launcher and lands in the table. Speed itself is measured on GPUs only (bench/results/speed.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_speed_bench_runs_every_variant_and_tabulates(tmp_path: Path) -> None:
    env = os.environ | {"DS_ACCELERATOR": "cpu"}
    run = [sys.executable, "bench/speed.py", "run", "--gpus", "2", "--out", str(tmp_path), "--only", "tiny-seq64",
           "--stages", "2", "--variants", "bare,raw,trainer,hf", "--warmup", "1", "--steps", "2", "--port", str(free_port())]
    p = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = [sys.executable, "bench/speed.py", "table", *map(str, sorted(tmp_path.glob("*.json"))),
             "--json", str(tmp_path / "speed.json"), "--command", "test"]
    md = subprocess.run(table, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert sorted(r["variant"] for r in rows) == ["bare", "hf", "raw", "trainer"], rows
    for r in rows:  # the same global batch for everyone, however it is split
        assert r["rc"] == 0 and r["tokens_per_s_per_gpu"] > 0, r
        assert r["micro_batch"] * r["grad_accum"] * r["gpus"] == 32, r
    assert "| tiny-seq64 | synthetic | 2 | 2 | raw |" in md


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_zero3_tuning_row_runs_the_preset_with_its_values_written_over(tmp_path: Path) -> None:
    env = os.environ | {"DS_ACCELERATOR": "cpu"}
    run = [sys.executable, "bench/speed.py", "run", "--gpus", "2", "--out", str(tmp_path), "--only", "tiny-seq64",
           "--stages", "3", "--variants", "raw", "--tune", "sizes", "--warmup", "1", "--steps", "2",
           "--port", str(free_port())]
    p = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tuned = json.loads((tmp_path / "tiny-seq64-z3-2gpu-raw-sizes.json").read_text())
    assert tuned["rc"] == 0 and tuned["step_times_s"], tuned
    ran = json.loads((tmp_path / "tiny-seq64-z3-2gpu-raw-sizes" / "ds_config.json").read_text())["zero_optimization"]
    assert ran["stage3_prefetch_bucket_size"] == 1.2e8 and ran["stage3_param_persistence_threshold"] == 1e6
