"""GPU tier (run on a 2-GPU machine): the ~1B preset through both paths at ZeRO-2, ZeRO-3 and
ZeRO-3 with offload, via bench/seeds.py so the same run also yields the committed figures.

    TOOLKIT_BENCH_OUT=DIR pytest tests/gpu   # keeps the result JSON and run dirs in DIR
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu(2)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = Path(os.environ.get("TOOLKIT_BENCH_OUT", tmp_path_factory.mktemp("gpu")))
    cmd = [sys.executable, "bench/seeds.py", "suite", "--runner", "toolkit", "--suite", "llama-2gpu", "--gpus", "2",
           "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=850)
    return json.loads((out / "toolkit-llama-2gpu.json").read_text())["results"]


@pytest.mark.timeout(900)
def test_llama_1b_both_paths_complete_and_agree(results: dict) -> None:
    assert all(r["rc"] == 0 for r in results.values()), results
    for r in results.values():
        # random init starts near ln(vocab) on every stage: weights are really initialized
        assert abs(r["losses"][0] - math.log(128256)) < 0.1 * math.log(128256)
    for stage in ("zero2", "zero3", "zero3_offload"):
        raw, tr = results[f"raw-{stage}"]["losses"], results[f"trainer-{stage}"]["losses"]
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(raw, tr, strict=True)), (raw, tr)


@pytest.mark.timeout(900)
def test_llama_1b_per_rank_memory_ordering(results: dict) -> None:
    for path in ("raw", "trainer"):
        z2, z3, off = (results[f"{path}-{s}"] for s in ("zero2", "zero3", "zero3_offload"))
        for rank in ("0", "1"):
            peak = {n: r["per_rank"][rank]["peak_allocated_gib"] for n, r in (("z2", z2), ("z3", z3), ("off", off))}
            assert peak["z3"] < peak["z2"] and peak["off"] < peak["z3"], peak
            for r in (z2, z3, off):
                m = r["per_rank"][rank]
                assert m["nvml_used_gib"] >= m["reserved_gib"], m
