"""MemoryMonitor on CPU: the same code path as on GPU, with the GPU fields null."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.observe import memory
from toolkit.observe.memory import FIELDS, MemoryMonitor, format_table, oom_message

GPU_FIELDS = (
    "allocated_gib",
    "reserved_gib",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "nvml_used_gib",
    "alloc_retries",
    "oom_count",
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU (null GPU fields) path")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_snapshot_has_every_field_on_cpu(tmp_path: Path) -> None:
    mon = MemoryMonitor(tmp_path, rank=3, world_size=4, local_rank=1)
    snap = mon.snapshot("model_loaded", 0)
    assert tuple(snap) == FIELDS
    for key in GPU_FIELDS:
        assert snap[key] is None, key
    assert snap["host_rss_gib"] > 0
    assert snap["device"] == "cpu"
    assert (snap["rank"], snap["local_rank"], snap["phase"], snap["step"]) == (3, 1, "model_loaded", 0)
    (line,) = _lines(tmp_path / "memory" / "rank3.jsonl")
    assert line == snap


def test_phases_appended_in_order(tmp_path: Path) -> None:
    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0)
    phases = ["model_loaded", "engine_ready", "first_step", "step", "final"]
    for i, phase in enumerate(phases):
        mon.snapshot(phase, i)
    # A second monitor on the same run dir (e.g. resume) appends, never truncates.
    MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0).snapshot("final", 9)
    rows = _lines(tmp_path / "memory" / "rank0.jsonl")
    assert [r["phase"] for r in rows] == [*phases, "final"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 9]
    assert all(set(r) == set(FIELDS) for r in rows)


@pytest.mark.parametrize(("every", "expected"), [(3, [3, 6, 9]), (1, list(range(1, 11))), (0, [])])
def test_maybe_step_every_n(tmp_path: Path, every: int, expected: list[int]) -> None:
    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0, every=every)
    taken = [s for s in range(1, 11) if mon.maybe_step(s) is not None]
    assert taken == expected
    path = tmp_path / "memory" / "rank0.jsonl"
    steps = [r["step"] for r in _lines(path)] if path.exists() else []
    assert steps == expected


def _row(rank: int, alloc: float | None, retries: int | None = 0, rss: float = 1.5) -> dict:
    return {
        "rank": rank,
        "allocated_gib": alloc,
        "reserved_gib": None if alloc is None else alloc + 1.0,
        "peak_allocated_gib": None if alloc is None else alloc + 0.5,
        "peak_reserved_gib": None if alloc is None else alloc + 1.5,
        "nvml_used_gib": None if alloc is None else alloc + 2.0,
        "host_rss_gib": rss,
        "alloc_retries": retries,
        "step": 5,
    }


def test_format_table_stats_and_no_warnings() -> None:
    rows = [_row(1, 10.0, rss=2.0), _row(0, 11.0, rss=1.0)]
    text, warnings = format_table(rows, "first_step", 5, spread_warn_gib=2.0)
    assert warnings == []
    lines = text.splitlines()
    assert lines[0] == "memory @ first_step (step 5) [GiB]"
    assert lines[1].split()[:3] == ["rank", "alloc", "reserved"]
    body = [ln.split() for ln in lines if ln.strip() and ln.split()[0] in {"0", "1", "max", "min", "spread"}]
    by_first = {cells[0]: cells for cells in body}
    assert [c[0] for c in body] == ["0", "1", "max", "min", "spread"]  # rows sorted by rank
    assert by_first["max"][1:3] == ["11.00", "12.00"]
    assert by_first["min"][1:3] == ["10.00", "11.00"]
    assert by_first["spread"][1] == "1.00"
    assert by_first["spread"][6] == "1.00"  # host rss 2.0 - 1.0


def test_format_table_warnings() -> None:
    rows = [_row(0, 1.0, retries=0), _row(1, 5.5, retries=3)]
    text, warnings = format_table(rows, "step", 10, prev_retries={0: 0, 1: 1}, spread_warn_gib=2.0)
    assert len(warnings) == 2
    assert "retries grew on rank 1 (1 -> 3)" in warnings[0]
    assert "spread 4.50 GiB" in warnings[1] and "rank 1" in warnings[1]
    assert all(w in text for w in warnings)
    # Unchanged retries and a spread under the threshold: quiet.
    _, quiet = format_table(rows, "step", 10, prev_retries={0: 0, 1: 3}, spread_warn_gib=5.0)
    assert quiet == []


def test_format_table_cpu_rows_are_one_line() -> None:
    """No GPU fields anywhere (a CPU run): one line instead of a table of dashes."""
    rows = [_row(1, None, retries=None, rss=3.0), _row(0, None, retries=None, rss=1.0)]
    text, warnings = format_table(rows, "final", 5)
    assert warnings == []
    assert text == "memory @ final (step 5): host RSS rank 0 1.00, rank 1 3.00 GiB (CPU run: no GPU memory)"
    many = [_row(r, None, retries=None, rss=1.0 + r) for r in range(16)]
    text, _ = format_table(many, "step")
    assert text == "memory @ step: host RSS max 16.00 GiB (rank 15), min 1.00 GiB (rank 0) (CPU run: no GPU memory)"
    # one rank with GPU fields is enough for the full table
    text, _ = format_table([_row(0, None, retries=None), _row(1, 2.0)], "final")
    assert text.splitlines()[0] == "memory @ final [GiB]"


def test_run_peaks_and_tensorboard(tmp_path: Path) -> None:
    """Run-wide peaks over snapshots (the closing summary reads them) and this rank's TensorBoard file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0, tensorboard=True)
    snaps = [mon.snapshot("model_loaded", 0), mon.snapshot("engine_ready", 0), mon.snapshot("final", 3)]
    mon.table("final")  # one process: "gathers" its own peaks
    mon.close()
    rss = max(s["host_rss_gib"] for s in snaps)
    assert mon.run_peaks == {"peak_allocated_gib": None, "nvml_used_gib": None, "host_rss_gib": rss}
    assert mon.rank_peaks == {0: mon.run_peaks}
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["memory/host_rss_gib"]  # null GPU fields are not written
    events = acc.Scalars("memory/host_rss_gib")
    assert [e.step for e in events] == [0, 0, 3]
    assert [e.value for e in events] == pytest.approx([s["host_rss_gib"] for s in snaps], rel=1e-6)
    assert [e.wall_time for e in events] == pytest.approx([s["ts"] for s in snaps])
    # off by default for a bare monitor (the training loop passes metrics.tensorboard)
    MemoryMonitor(tmp_path / "off", rank=0, world_size=1, local_rank=0).snapshot("final", 1)
    assert not (tmp_path / "off" / "tb").exists()


def test_table_single_process_prints_on_rank0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0)
    text = mon.phase_boundary("engine_ready", 0)
    assert text is not None and "memory @ engine_ready" in text
    assert text in capsys.readouterr().out


def test_on_oom_writes_what_it_can_on_cpu(tmp_path: Path) -> None:
    mon = MemoryMonitor(tmp_path, rank=1, world_size=2, local_rank=1)
    mon.on_oom("step", 7, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    rows = _lines(tmp_path / "memory" / "rank1.jsonl")
    assert rows[-1]["phase"] == "oom" and rows[-1]["step"] == 7
    report = (tmp_path / "memory" / "rank1_oom.txt").read_text()
    assert "during step (step 7)" in report and "Tried to allocate" in report


def test_oom_guard_reraises_with_rank_phase_step(tmp_path: Path) -> None:
    mon = MemoryMonitor(tmp_path, rank=2, world_size=4, local_rank=0)
    phase, step = "step", 0
    expected = r"CUDA out of memory on rank 2 during step \(step 4\)"
    # The guard reads `phase` and `step` through the closure at failure time, as the loop will.
    with pytest.raises(RuntimeError, match=expected) as info, mon.oom_guard(lambda: (phase, step)):
        for step in range(1, 10):
            if step == 4:
                raise torch.OutOfMemoryError("CUDA out of memory")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert (tmp_path / "memory" / "rank2_oom.txt").exists()
    # Other errors pass through untouched.
    with pytest.raises(ValueError, match="boom"), mon.oom_guard(lambda: ("step", 1)):
        raise ValueError("boom")


def test_oom_message() -> None:
    msg = oom_message(3, "first_step", 1, "runs/x")
    assert "train.zero_sizes=memory" in msg  # the memory-lean sizes are the answer when memory is tight
    assert msg.startswith("CUDA out of memory on rank 3 during first_step (step 1); see ")
    assert "rank3_oom.txt" in msg


def test_snapshot_cost_is_small(tmp_path: Path) -> None:
    # Not a timing claim (that belongs to GPU bench runs): a guard against accidental heavy work.
    import time

    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0, every=1)
    t0 = time.perf_counter()
    for s in range(200):
        mon.maybe_step(s)
    assert (time.perf_counter() - t0) / 200 < 0.01


def test_memory_callback_is_lazy_and_drives_phases(tmp_path: Path) -> None:
    from types import SimpleNamespace

    cb_cls = memory.MemoryCallback
    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=0, every=2)
    cb = cb_cls(mon)
    state = SimpleNamespace(global_step=0)
    cb.on_train_begin(None, state, None)
    for s in range(1, 6):
        state.global_step = s
        cb.on_step_end(None, state, None)
    cb.on_train_end(None, state, None)
    rows = _lines(tmp_path / "memory" / "rank0.jsonl")
    assert [(r["phase"], r["step"]) for r in rows] == [
        ("engine_ready", 0),
        ("first_step", 1),
        ("step", 2),
        ("step", 4),
        ("final", 5),
    ]


def test_gpu_branch_with_fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch on a CPU box: one memory_stats call, peak reset, NVML handle by UUID (cached)."""
    import sys
    from types import SimpleNamespace

    gib = 1 << 30
    stats = {
        "allocated_bytes.all.current": 2 * gib,
        "reserved_bytes.all.current": 3 * gib,
        "allocated_bytes.all.peak": 4 * gib,
        "reserved_bytes.all.peak": 5 * gib,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    resets: list[int] = []
    lookups: list[str] = []

    class FakeNVMLError(Exception):
        pass

    def by_uuid(name: str) -> str:
        lookups.append(name)
        if not name.startswith("GPU-"):
            raise FakeNVMLError(name)
        return "handle"

    fake_nvml = SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=6 * gib),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: resets.append(dev))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(uuid="abcd-1234"))

    mon = MemoryMonitor(tmp_path, rank=0, world_size=1, local_rank=1)
    mon._cuda = True
    snap = mon.snapshot("step", 3)
    mon.snapshot("step", 4)
    assert snap["device"] == "cuda:1"
    assert (snap["allocated_gib"], snap["reserved_gib"]) == (2.0, 3.0)
    assert (snap["peak_allocated_gib"], snap["peak_reserved_gib"]) == (4.0, 5.0)
    assert (snap["nvml_used_gib"], snap["alloc_retries"], snap["oom_count"]) == (6.0, 2, 1)
    assert resets == [1, 1]
    assert lookups == ["GPU-abcd-1234"]  # handle cached after the first lookup

    # NVML failing (no driver, MIG without access): null, never a crash, never retried per step.
    monkeypatch.setattr(
        fake_nvml, "nvmlDeviceGetHandleByUUID", lambda name: (_ for _ in ()).throw(FakeNVMLError())
    )
    mon2 = MemoryMonitor(tmp_path, rank=1, world_size=1, local_rank=1)
    mon2._cuda = True
    assert mon2.snapshot("step", 1)["nvml_used_gib"] is None
    assert mon2.snapshot("step", 2)["allocated_gib"] == 2.0


def test_gpu_limit_is_checked_and_a_no_op_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit.config.ds_config import ConfigError
    from toolkit.config.schema import MemoryConfig
    from toolkit.launch import dist

    with pytest.raises(ConfigError, match=r"memory\.gpu_limit_gib must be >= 0"):
        MemoryConfig(gpu_limit_gib=-1)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    dist.limit_gpu_memory(77)
    assert dist._gpu_limit_bytes is None
