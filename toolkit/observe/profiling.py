"""train.profile_steps=[first,last]: torch.profiler over those optimizer steps, on every rank.

Writes run_dir/profile/rank{N}.trace.json (open in https://ui.perfetto.dev or chrome://tracing) and
rank{N}.summary.json: the window's wall time, how long the GPU ran kernels in it (busy), how long the
host sat in CUDA synchronize calls, and the top operators by host and by GPU time. A GPU busy for a
small part of the wall time means a host-bound step (Python hooks, launches); long synchronize waits
mean the host waited on the GPU where it could have queued work.

Why by hand rather than torch.profiler's schedule and tensorboard_trace_handler: the window is named
in optimizer steps, which the Trainer and the raw loop count in different places, and the summary
(busy time as a union of kernel intervals) is not something torch.profiler reports.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

# CUDA runtime calls in which the host waits for the device (cudaStreamWaitEvent is a wait on the device)
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class StepProfiler:
    """Call `step_done(step)` when training starts (with the step it starts from: 0, or the resumed one)
    and after each optimizer step, and `close()` at the end of training (also when it failed).

    The window opens once, at the first call with first-1 <= step < last (so a run resumed inside
    the window profiles its remainder), and the summary names the steps it really covered. Where the
    step ends: the raw loop after a step's logging and saving, the HF Trainer at `on_step_end`, which
    comes before its logging and saving; so on log or save steps the two paths' windows differ by those."""

    def __init__(self, run_dir: Path, rank: int, steps: list[int]) -> None:
        self.dir, self.rank = run_dir / "profile", rank
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.prof: Any = None
        self.opened_at = 0  # the step count when the window opened
        self.done = not steps
        self.t0 = 0.0

    def step_done(self, step: int) -> None:
        """`step` optimizer steps are done."""
        if self.prof is None and not self.done and self.first - 1 <= step < self.last:
            self.opened_at = step
            self._start()
        elif self.prof is not None and step >= self.last:
            self._stop(step)

    def close(self, step: int) -> None:
        """Training ended (or failed) inside the window: keep what it recorded, if it covers a step."""
        if self.prof is None:
            return
        if step > self.opened_at:
            self._stop(step)
        else:  # no step ran inside the window
            self.prof.stop()
            self.prof, self.done = None, True

    def _start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()  # the window starts with an empty queue
        # TOOLKIT_PROFILE_STACK=1: Python call stacks in the trace (bench/profile_syncs.py names who synchronizes)
        self.prof = torch.profiler.profile(activities=acts, with_stack=os.environ.get("TOOLKIT_PROFILE_STACK") == "1")
        self.prof.start()
        self.t0 = time.perf_counter()

    def _stop(self, step: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}.trace.json"
        self.prof.export_chrome_trace(str(trace))
        summary = {"rank": self.rank, "steps": [self.opened_at + 1, step], **summarize(trace, wall),
                   "top_host_ops": _top(self.prof, "self_cpu_time_total"),
                   "top_gpu_ops": _top(self.prof, "self_device_time_total") if torch.cuda.is_available() else []}
        (self.dir / f"rank{self.rank}.summary.json").write_text(json.dumps(summary, indent=1))
        if self.rank == 0:
            busy = summary["gpu_busy_s"]
            seen = (f"GPU busy {busy:.2f} s ({busy / wall:.0%}), host waiting in CUDA syncs {summary['host_sync_s']:.2f} s"
                    if torch.cuda.is_available() else "host only (no CUDA)")
            print(f"profile: steps {self.opened_at + 1}-{step} in {wall:.2f} s; {seen}; trace and summary in "
                  f"{self.dir}", flush=True)
        self.prof, self.done = None, True


def summarize(trace: Path, wall_s: float) -> dict[str, Any]:
    """From a Chrome trace: kernel time as the union of kernel intervals (streams overlap), and the
    host's time inside CUDA synchronize calls."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in device):
        if b > end:
            busy += b - max(a, end)
            end = b
    sync = sum(e.get("dur", 0) for e in events if e.get("ph") == "X" and e.get("name") in _SYNC_CALLS)
    return {"wall_s": round(wall_s, 4), "gpu_busy_s": round(busy / 1e6, 6),
            "kernels": sum(e["cat"] == "kernel" for e in device), "copies": sum(e["cat"] != "kernel" for e in device),
            "host_sync_s": round(sync / 1e6, 6)}


def _top(prof: Any, key: str, n: int = 25) -> list[dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:n]
    return [{"name": e.key, "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 2),
             "self_gpu_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 2)} for e in rows]
