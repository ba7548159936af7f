"""train.profile_steps: the window in optimizer steps, the files it writes, and the summary's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.observe.profiling import StepProfiler, summarize


def _work() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


def test_the_window_covers_steps_first_to_last_and_writes_trace_and_summary(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 0, [2, 3])
    for step in range(1, 6):  # after step 1 it starts; after step 3 it stops
        _work()
        prof.step_done(step)
        assert (prof.prof is not None) == (step in (1, 2))
    prof.close(5)  # already stopped: nothing more
    summary = json.loads((tmp_path / "profile" / "rank0.summary.json").read_text())
    assert summary["steps"] == [2, 3] and summary["wall_s"] > 0
    assert any(op["name"] == "aten::mm" for op in summary["top_host_ops"])
    assert json.loads((tmp_path / "profile" / "rank0.trace.json").read_text())["traceEvents"]


def test_a_run_ending_inside_the_window_still_writes_it(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 1, [2, 50])
    for step in range(1, 4):
        _work()
        prof.step_done(step)
    prof.close(3)
    assert json.loads((tmp_path / "profile" / "rank1.summary.json").read_text())["steps"] == [2, 3]


def test_a_window_from_step_1_starts_when_training_starts(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 0, [1, 1])
    prof.step_done(0)  # the loops call this before their first step
    _work()
    prof.step_done(1)
    assert json.loads((tmp_path / "profile" / "rank0.summary.json").read_text())["steps"] == [1, 1]


def test_a_run_resumed_inside_the_window_profiles_its_remainder(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 0, [2, 4])
    prof.step_done(2)  # resumed after step 2
    for step in (3, 4):
        _work()
        prof.step_done(step)
    assert json.loads((tmp_path / "profile" / "rank0.summary.json").read_text())["steps"] == [3, 4]


def test_a_run_ending_before_the_window_writes_nothing(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 0, [5, 6])
    for step in range(0, 5):  # opens after step 4, then the run ends
        prof.step_done(step)
    prof.close(4)
    assert not (tmp_path / "profile").exists()
    prof.step_done(4)  # never reopens
    assert prof.prof is None


def test_off_by_default(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, 0, [])
    for step in range(1, 4):
        prof.step_done(step)
    prof.close(3)
    assert not (tmp_path / "profile").exists()


def test_busy_time_is_the_union_of_kernel_intervals_and_syncs_are_summed(tmp_path: Path) -> None:
    ev = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10},
          {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 10},  # overlaps: 0..15 counts once
          {"ph": "X", "cat": "gpu_memcpy", "name": "m", "ts": 20, "dur": 5},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 7},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    s = summarize(trace, 1.0)
    assert s["gpu_busy_s"] == pytest.approx(20e-6) and s["kernels"] == 2 and s["copies"] == 1
    assert s["host_sync_s"] == pytest.approx(7e-6)


@pytest.mark.parametrize("bad", ["[3]", "[0,2]", "[5,2]"])
def test_bad_windows_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.profile_steps must be"):
        load_config(None, [f"train.profile_steps={bad}"])


def test_a_window_after_the_last_step_is_refused_before_launch(tmp_path: Path) -> None:
    from toolkit.runtime.spec import build_spec, read_inputs

    ds = Path(__file__).resolve().parents[2] / "ds_configs" / "zero2.json"
    common = ["model.name=tiny", "train.max_steps=5", f"train.ds_config={ds}", f"train.run_dir={tmp_path / 'r'}"]
    with pytest.raises(ConfigError, match=r"starts after the run's last step \(5\)"):
        build_spec(read_inputs(load_config(None, [*common, "train.profile_steps=[6,8]"])))
    assert list(build_spec(read_inputs(load_config(None, [*common, "train.profile_steps=[5,8]"]))).cfg.train.profile_steps) == [5, 8]


def test_profile_functions_counts_a_function_nested_in_itself_once() -> None:
    """bench/profile_functions.py: calls count every event, milliseconds only the outermost of a name on a thread (a
    module's `_call_impl` inside another's is wall time once), and the patterns keep what holds one of them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "profile_functions", Path(__file__).resolve().parents[2] / "bench" / "profile_functions.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    functions = module.functions

    def ev(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    trace = {"traceEvents": [ev("call", 0, 1000), ev("call", 100, 500), ev("call", 2000, 1000),
                             ev("call", 0, 3000, tid=2), ev("fetch", 200, 300),
                             {"ph": "X", "cat": "cpu_op", "name": "call", "ts": 0, "dur": 9e9}]}
    rows = {r["name"]: r for r in functions(trace, [])}
    assert rows["call"]["calls"] == 4 and rows["call"]["ms"] == 5.0  # 1 + 1 on thread 1, 3 on thread 2
    assert rows["fetch"] == {"name": "fetch", "calls": 1, "ms": 0.3, "per_call_ms": 0.3}
    assert [r["name"] for r in functions(trace, ["fet"])] == ["fetch"]
