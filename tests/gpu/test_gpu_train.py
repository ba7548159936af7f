"""GPU tier (run on a 2-GPU machine), via bench/seeds.py so the same run also yields the committed figures:
the ~1B preset through both paths at ZeRO-2, ZeRO-3 and ZeRO-3 with offload, and the Qwen2-0.5B SFT
workload of the seeds at the same three stages.

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


def _suite(name: str, out: Path) -> dict:
    cmd = [sys.executable, "bench/seeds.py", "suite", "--runner", "toolkit", "--suite", name, "--gpus", "2",
           "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=850)
    return json.loads((out / f"toolkit-{name}.json").read_text())["results"]


def _out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(os.environ.get("TOOLKIT_BENCH_OUT", tmp_path_factory.mktemp("gpu")))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _suite("llama-2gpu", _out(tmp_path_factory))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _suite("qwen-2gpu", _out(tmp_path_factory))


def _assert_memory_ordering(z2: dict, z3: dict, off: dict) -> None:
    """Per rank: ZeRO-3 peaks below ZeRO-2, offload below ZeRO-3, NVML sees at least what torch reserved."""
    for rank in ("0", "1"):
        peak = {n: r["per_rank"][rank]["peak_allocated_gib"] for n, r in (("z2", z2), ("z3", z3), ("off", off))}
        assert peak["z3"] < peak["z2"] and peak["off"] < peak["z3"], (rank, peak)
        for r in (z2, z3, off):
            m = r["per_rank"][rank]
            assert m["nvml_used_gib"] >= m["reserved_gib"], m


@pytest.mark.timeout(900)
def test_llama_1b_both_paths_complete_and_agree(llama: dict) -> None:
    assert all(r["rc"] == 0 for r in llama.values()), llama
    for r in llama.values():
        # random init starts near ln(vocab) on every stage: weights are really initialized
        assert abs(r["losses"][0] - math.log(128256)) < 0.1 * math.log(128256)
    for stage in ("zero2", "zero3", "zero3_offload"):
        raw, tr = llama[f"raw-{stage}"]["losses"], llama[f"trainer-{stage}"]["losses"]
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(raw, tr, strict=True)), (raw, tr)


@pytest.mark.timeout(900)
def test_llama_1b_per_rank_memory_ordering(llama: dict) -> None:
    for path in ("raw", "trainer"):
        _assert_memory_ordering(*(llama[f"{path}-{s}"] for s in ("zero2", "zero3", "zero3_offload")))


@pytest.mark.timeout(900)
def test_qwen_0_5b_per_rank_memory_ordering(qwen: dict) -> None:
    assert all(r["rc"] == 0 for r in qwen.values()), qwen
    _assert_memory_ordering(*(qwen[f"qwen-{s}"] for s in ("zero2", "zero3", "zero3_offload")))
