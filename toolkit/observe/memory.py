"""Per-rank memory snapshots (allocator, NVML, host RSS) and a cross-rank table at phase boundaries.

Each rank appends its own JSON lines to ``run_dir/memory/rank{N}.jsonl``; writing needs no
collective, so the files survive a hang or crash on another rank. ``table()`` is the only
collective: every rank calls it at the same phase boundary and rank 0 prints one row per rank.
On CPU the GPU fields are null, so CPU tests run the same code as GPU runs.

The same monitor serves the raw loop (call ``phase_boundary``/``maybe_step``/``oom_guard``
directly) and the HF Trainer path (``MemoryCallback``, created lazily so the raw loop and
``toolkit`` CLI do not pay for importing transformers).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import torch

GIB = float(1 << 30)

PHASES = ("model_loaded", "engine_ready", "first_step", "step", "final", "oom")

# Every snapshot carries all of these keys (null where not applicable), in this order.
FIELDS = (
    "ts",
    "rank",
    "local_rank",
    "phase",
    "step",
    "allocated_gib",
    "reserved_gib",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "nvml_used_gib",
    "host_rss_gib",
    "alloc_retries",
    "oom_count",
    "device",
)

# (header, snapshot key, is a GiB value) for the cross-rank table.
TABLE_COLUMNS = (
    ("alloc", "allocated_gib", True),
    ("reserved", "reserved_gib", True),
    ("peak alloc", "peak_allocated_gib", True),
    ("peak res", "peak_reserved_gib", True),
    ("nvml used", "nvml_used_gib", True),
    ("host rss", "host_rss_gib", True),
    ("retries", "alloc_retries", False),
)

# run-wide peak key -> the snapshot key to use when it is null (allocated when no peak was read)
PEAK_KEYS = {"peak_allocated_gib": "allocated_gib", "nvml_used_gib": "nvml_used_gib",
             "host_rss_gib": "host_rss_gib"}

_NVML_FAILED = object()  # cached "this device has no usable NVML handle": never retry per step


def _gib(n_bytes: float | int | None) -> float | None:
    # Not rounded: bytes / 2**30 is exact in a float, so peaks compare to the byte (the bench holds
    # the toolkit to "no more than plain HF Trainer", and 4 decimals hid a 50 KB difference).
    return None if n_bytes is None else n_bytes / GIB


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA OOM, including the plain RuntimeError some extensions still raise."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_message(rank: int, phase: str, step: int, run_dir: Path | str | None = None) -> str:
    """The error the training code raises after an OOM: which rank, when, and where to look."""
    where = Path(run_dir) / "memory" if run_dir is not None else Path("RUN_DIR") / "memory"
    return (
        f"CUDA out of memory on rank {rank} during {phase} (step {step}); see {where}/rank{rank}_oom.txt "
        f"and {where}/rank{rank}.jsonl (or run `toolkit report RUN_DIR`). Lower train.micro_batch_size, "
        f"enable model.gradient_checkpointing, use train.zero_sizes=memory (smaller ZeRO buckets and fewer "
        f"live ZeRO-3 parameters, at some speed), raise the ZeRO stage or offload."
    )


def _fmt(value: float | int | None, is_gib: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if is_gib else str(int(value))


def format_table(
    rows: list[dict[str, Any]],
    phase: str,
    step: int | None = None,
    prev_retries: dict[int, int] | None = None,
    spread_warn_gib: float = 2.0,
) -> tuple[str, list[str]]:
    """Render one snapshot per rank as a fixed-width table plus max/min/spread rows.

    Returns (text, warnings); the warnings are also appended to the text. Pure function so unit
    tests can feed fabricated rows. ``prev_retries`` is rank -> alloc_retries at the previous table.
    """
    rows = sorted(rows, key=lambda r: r.get("rank", 0))
    if not any(r.get(k) is not None for r in rows for _, k, is_gib in TABLE_COLUMNS[:5]):
        return _cpu_line(rows, phase, step), []
    headers = ["rank", *(h for h, _, _ in TABLE_COLUMNS)]
    body: list[list[str]] = [
        [str(r.get("rank")), *(_fmt(r.get(k), g) for _, k, g in TABLE_COLUMNS)] for r in rows
    ]
    stats: dict[str, list[str]] = {"max": ["max"], "min": ["min"], "spread": ["spread"]}
    for _, key, is_gib in TABLE_COLUMNS:
        vals = [r[key] for r in rows if r.get(key) is not None]
        hi, lo = (max(vals), min(vals)) if vals else (None, None)
        stats["max"].append(_fmt(hi, is_gib))
        stats["min"].append(_fmt(lo, is_gib))
        stats["spread"].append(_fmt(None if hi is None else hi - lo, is_gib))
    all_rows = [headers, *body, *stats.values()]
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))

    sep = "  ".join("-" * w for w in widths)
    title = f"memory @ {phase}" + (f" (step {step})" if step is not None else "") + " [GiB]"
    lines = [title, line(headers), sep, *(line(b) for b in body), sep, *(line(s) for s in stats.values())]

    warnings: list[str] = []
    prev = prev_retries or {}
    for r in rows:
        now = r.get("alloc_retries")
        before = prev.get(r.get("rank", -1), 0)
        if now is not None and now > before:
            # Retries mean the caching allocator hit its limit, freed its cache and retried: the
            # step survives but stalls; the next step up in memory is an OOM.
            warnings.append(
                f"WARNING: allocator retries grew on rank {r.get('rank')} ({before} -> {now}): memory "
                f"pressure or fragmentation; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                f"or a smaller micro batch"
            )
    alloc = [(r["allocated_gib"], r.get("rank")) for r in rows if r.get("allocated_gib") is not None]
    if len(alloc) > 1:
        (hi, hi_rank), (lo, lo_rank) = max(alloc), min(alloc)
        if hi - lo > spread_warn_gib:
            warnings.append(
                f"WARNING: allocated spread {hi - lo:.2f} GiB across ranks > {spread_warn_gib:.2f} GiB "
                f"(rank {hi_rank}: {hi:.2f}, rank {lo_rank}: {lo:.2f}): uneven partitioning or "
                f"rank-specific work (eval, logging, generation on one rank)"
            )
    return "\n".join(lines + warnings), warnings


def _cpu_line(rows: list[dict[str, Any]], phase: str, step: int | None) -> str:
    """No GPU fields (a CPU run): a table would be all dashes, so one line with what there is."""
    where = f"memory @ {phase}" + (f" (step {step})" if step is not None else "")
    rss = {r.get("rank"): r["host_rss_gib"] for r in rows if r.get("host_rss_gib") is not None}
    if not rss:
        return f"{where}: no GPU and no host RSS reading"
    if len(rss) <= 8:
        per_rank = ", ".join(f"rank {k} {v:.2f}" for k, v in rss.items()) + " GiB"
    else:
        hi, lo = max(rss, key=rss.__getitem__), min(rss, key=rss.__getitem__)
        per_rank = f"max {rss[hi]:.2f} GiB (rank {hi}), min {rss[lo]:.2f} GiB (rank {lo})"
    return f"{where}: host RSS {per_rank} (CPU run: no GPU memory)"


class MemoryMonitor:
    """Per-rank memory snapshots to ``run_dir/memory/rank{rank}.jsonl`` and a rank-0 table.

    A snapshot is cheap (one allocator-stats call, one NVML query, one /proc read, one appended
    line) and never synchronizes the device, so ``every=1`` stays well under 1% of a step.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        local_rank: int,
        every: int = 10,
        spread_warn_gib: float = 2.0,
        tensorboard: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.every = every
        self.spread_warn_gib = spread_warn_gib
        self.dir = self.run_dir / "memory"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{rank}.jsonl"
        self.oom_path = self.dir / f"rank{rank}_oom.txt"
        self.last: dict[str, Any] | None = None
        self._process = psutil.Process()
        self._cuda = torch.cuda.is_available()
        self._nvml: dict[int, Any] = {}  # device index -> handle or _NVML_FAILED
        self._prev_retries: dict[int, int] = {}  # rank 0 only: retries at the previous table
        # This rank's peaks over the whole run (a snapshot's peak covers only its window), and on
        # rank 0 every rank's, gathered with each table: the closing summary reads them.
        self.run_peaks: dict[str, float | None] = dict.fromkeys(PEAK_KEYS)
        self.rank_peaks: dict[int, dict[str, float | None]] = {}
        self._tb: Any = None
        if tensorboard:
            from toolkit.observe.tb import MemoryWriter

            self._tb = MemoryWriter(self.run_dir, rank)

    # -- snapshots ---------------------------------------------------------------------------

    def _cuda_device(self) -> int | None:
        # Read the current device at snapshot time, not at construction: the monitor may be
        # built before deepspeed/dist init calls torch.cuda.set_device(local_rank).
        if not self._cuda:
            return None
        return torch.cuda.current_device()

    def _nvml_used_gib(self, dev: int) -> float | None:
        handle = self._nvml.get(dev)
        if handle is None:
            handle = self._nvml[dev] = self._nvml_handle(dev)
        if handle is _NVML_FAILED:
            return None
        try:
            import pynvml

            return _gib(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            return None

    @staticmethod
    def _nvml_handle(dev: int) -> Any:
        """NVML handle by UUID: CUDA_VISIBLE_DEVICES remaps torch indices, NVML indices are physical."""
        try:
            import pynvml

            pynvml.nvmlInit()  # reference counted by NVML; cheap after the first call
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
            # torch prints the bare UUID; NVML wants the "GPU-" (or "MIG-" for MIG slices) prefix.
            names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
            for name in names:
                try:
                    return pynvml.nvmlDeviceGetHandleByUUID(name)
                except pynvml.NVMLError:
                    continue
        except Exception:
            pass
        return _NVML_FAILED

    def snapshot(self, phase: str, step: int) -> dict[str, Any]:
        """Take one snapshot, append it to this rank's file and return it. No collective."""
        snap: dict[str, Any] = dict.fromkeys(FIELDS)
        snap.update(ts=round(time.time(), 3), rank=self.rank, local_rank=self.local_rank)
        snap.update(phase=phase, step=int(step), device="cpu")
        dev = self._cuda_device()
        if dev is not None:
            # One memory_stats() call gives everything: memory_allocated() etc. each call it
            # again internally. Host-side allocator counters, so no synchronize is needed.
            stats = torch.cuda.memory_stats(dev)
            snap.update(
                allocated_gib=_gib(stats.get("allocated_bytes.all.current", 0)),
                reserved_gib=_gib(stats.get("reserved_bytes.all.current", 0)),
                peak_allocated_gib=_gib(stats.get("allocated_bytes.all.peak", 0)),
                peak_reserved_gib=_gib(stats.get("reserved_bytes.all.peak", 0)),
                alloc_retries=int(stats.get("num_alloc_retries", 0)),
                oom_count=int(stats.get("num_ooms", 0)),
                device=f"cuda:{dev}",
            )
            # Peaks are "since the last snapshot": a window, so a spike shows up where it happened.
            # Note this also resets torch.cuda.max_memory_allocated() for any other reader.
            torch.cuda.reset_peak_memory_stats(dev)
            snap["nvml_used_gib"] = self._nvml_used_gib(dev)
        try:
            snap["host_rss_gib"] = _gib(self._process.memory_info().rss)
        except Exception:
            snap["host_rss_gib"] = None
        self._append(snap)
        self._track_peaks(snap)
        if self._tb is not None:
            self._tb.write(snap)
        self.last = snap
        return snap

    def reading(self) -> dict[str, float | None]:
        """This rank's memory now, for the trackers' per-rank charts (toolkit/observe/trackers.py): the
        tracker-facing subset of a snapshot, read without writing a line or resetting the peak window
        (the snapshots own it; peak_allocated_gib is the peak since the last snapshot)."""
        out: dict[str, float | None] = dict.fromkeys(("allocated_gib", "peak_allocated_gib", "nvml_used_gib"))
        dev = self._cuda_device()
        if dev is not None:
            out["allocated_gib"] = _gib(torch.cuda.memory_allocated(dev))
            out["peak_allocated_gib"] = _gib(torch.cuda.max_memory_allocated(dev))
            out["nvml_used_gib"] = self._nvml_used_gib(dev)
        try:
            out["host_rss_gib"] = _gib(self._process.memory_info().rss)
        except Exception:
            out["host_rss_gib"] = None
        return out

    def _track_peaks(self, snap: dict[str, Any]) -> None:
        for key, fallback in PEAK_KEYS.items():
            value = snap.get(key) if snap.get(key) is not None else snap.get(fallback)
            if value is not None:
                old = self.run_peaks[key]
                self.run_peaks[key] = value if old is None else max(old, value)

    def close(self) -> None:
        """Flush and close this rank's TensorBoard file (the JSON lines need no closing)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _append(self, snap: dict[str, Any]) -> None:
        # Open-append-close per line: the line is on disk even if this or another rank dies next.
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(snap) + "\n")
        except OSError as e:
            print(f"[memory] rank {self.rank}: cannot write {self.path}: {e}", flush=True)

    def maybe_step(self, step: int) -> dict[str, Any] | None:
        """Snapshot with phase "step" every ``every`` steps (0: never). No collective."""
        if self.every > 0 and step % self.every == 0:
            return self.snapshot("step", step)
        return None

    # -- cross-rank table (collective) -------------------------------------------------------

    def table(self, phase: str) -> str | None:
        """Collective: every rank must call it. Rank 0 prints and returns the table; others get None.

        Uses this rank's latest snapshot (taking one if there is none yet).
        """
        row = self.last if self.last is not None else self.snapshot(phase, 0)
        import torch.distributed as dist

        mine = {"row": row, "peaks": self.run_peaks}  # the peaks ride along: no second collective
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            rank = dist.get_rank()
        else:
            gathered, rank = [mine], self.rank
        if rank != 0:
            return None
        gathered = [g for g in gathered if g is not None]
        rows = [g["row"] for g in gathered]
        self.rank_peaks = {g["row"]["rank"]: dict(g["peaks"]) for g in gathered}
        text, _ = format_table(rows, phase, row.get("step"), self._prev_retries, self.spread_warn_gib)
        self._prev_retries = {
            r["rank"]: r["alloc_retries"] for r in rows if r.get("alloc_retries") is not None
        }
        from tqdm import tqdm

        # Through tqdm: a progress bar on the console is cleared and redrawn below the table
        # instead of the table starting in the middle of the bar's line.
        tqdm.write(text)
        sys.stdout.flush()
        return text

    def phase_boundary(self, phase: str, step: int) -> str | None:
        """Snapshot + cross-rank table. Collective: call on every rank."""
        self.snapshot(phase, step)
        return self.table(phase)

    # -- OOM ---------------------------------------------------------------------------------

    def on_oom(self, phase: str, step: int, exc: BaseException) -> None:
        """Record an OOM: an "oom" snapshot plus rank{N}_oom.txt. Never raises, never a collective
        (the other ranks are probably blocked in a collective already)."""
        try:
            snap: dict[str, Any] | None = self.snapshot("oom", step)
        except Exception:
            snap = None
        parts = [
            f"rank {self.rank} (local {self.local_rank}) out of memory during {phase} (step {step})",
            f"exception: {type(exc).__name__}: {exc}",
            "snapshot: " + json.dumps(snap),
        ]
        if self._cuda:
            try:
                parts.append(torch.cuda.memory_summary(self._cuda_device()))
            except Exception as e:
                parts.append(f"memory_summary failed: {e}")
        with suppress(OSError):
            self.oom_path.write_text("\n".join(parts) + "\n")

    def oom_message(self, phase: str, step: int) -> str:
        return oom_message(self.rank, phase, step, self.run_dir)

    @contextmanager
    def oom_guard(self, where: Callable[[], tuple[str, int]]) -> Iterator[None]:
        """Turn an OOM inside the block into on_oom + a RuntimeError naming rank, phase and step.

        ``where`` is called only after an OOM, so the loop passes ``lambda: (phase, step)`` and
        the closure reports the values current at the failure.
        """
        try:
            yield
        except Exception as exc:
            if not is_oom(exc):
                raise
            try:
                phase, step = where()
            except Exception:
                phase, step = "unknown", -1
            self.on_oom(phase, step, exc)
            raise RuntimeError(self.oom_message(phase, step)) from exc


def _make_callback_class() -> type:
    from transformers import TrainerCallback

    class MemoryCallback(TrainerCallback):
        """HF Trainer hook. Callbacks run on every rank, so the collective tables line up."""

        def __init__(self, monitor: MemoryMonitor) -> None:
            self.monitor = monitor
            self._first_done = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Trainer wraps the model with deepspeed.initialize before on_train_begin.
            self.monitor.phase_boundary("engine_ready", state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self._first_done:
                self._first_done = True
                self.monitor.phase_boundary("first_step", state.global_step)
            else:
                self.monitor.maybe_step(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.monitor.phase_boundary("final", state.global_step)

    return MemoryCallback


_callback_class: type | None = None


def __getattr__(name: str) -> Any:
    # `from toolkit.observe.memory import MemoryCallback` builds the class on first use: importing
    # transformers costs seconds, which the raw loop and the tests of the monitor should not pay.
    global _callback_class
    if name == "MemoryCallback":
        if _callback_class is None:
            _callback_class = _make_callback_class()
        return _callback_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
