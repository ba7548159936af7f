"""What each rank's memory holds, by category: parameters, gradients, optimizer states, and everything
else at the peak. Written per rank to run_dir/memory/breakdown_rank{N}.json.

DeepSpeed knows where its tensors are; this walks them once, after the first optimizer step (when
Adam's states exist), and counts each storage once (ZeRO's flat buffers are viewed by many
parameters):
  params     the model's parameters: ZeRO-1/2's bit16 flat groups, ZeRO-3's partitions (and
             anything gathered at that moment), on the GPU or, offloaded, on the host;
  optimizer  the inner optimizer's parameters (fp32 master copies) and its states (Adam m, v),
             with the GPU half of a partial offload (DeepSpeed's backup optimizer);
  grads      parameter .grad tensors and every DeepSpeed attribute naming gradients
             (ZeRO-3's grad_partitions_flat_buffer, ZeRO-1/2's averaged_gradients, CPU staging);
  other      allocated minus the three, at the same moment; and at the run's peak, the peak
             allocated (torch's allocator) minus the three: activations, logits, buckets, gathers.
The three are what a rank holds between steps, the planner's `persistent` prediction; plan.json
(when the run came from `toolkit plan -o`) is copied next to these files and `toolkit report` puts
the two side by side.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
FILE = "breakdown_rank{rank}.json"
PLAN_FILE = "plan.json"


def _tensors(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors inside an attribute value: a tensor, or lists / tuples / dicts of them (a few levels)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)
    elif depth < 3 and hasattr(obj, "buffer") and isinstance(getattr(obj, "buffer", None), list):
        yield from _tensors(obj.buffer, depth + 1)  # DeepSpeed's IPGBucket


class _Counter:
    """Bytes per (category, device kind), each storage counted once, in the first category that saw it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, dict[str, int]] = {}

    def add(self, category: str, tensors: Iterator[Any]) -> None:
        for t in tensors:
            if t is None or t.numel() == 0 or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or key == 0:
                continue
            self.seen.add(key)
            where = "host" if t.device.type == "cpu" else "gpu"
            bucket = self.bytes.setdefault(where, {})
            bucket[category] = bucket.get(category, 0) + storage.nbytes()


def measure(engine: Any) -> dict[str, dict[str, int]]:
    """{"gpu": {"params": bytes, "optimizer": ..., "grads": ...}, "host": {...}} of a DeepSpeed engine."""
    c = _Counter()
    module = engine.module
    params = list(module.parameters())
    c.add("params", (t for p in params for t in ((getattr(p, "ds_tensor", None)), p.data)))
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", None) if zero is not None else None
    opts = [o for o in (inner if inner is not None else zero, getattr(zero, "backup_optimizer", None)) if o is not None]
    # fp32 master copies: the inner optimizers' parameters, and ZeRO's own lists of them (ZeRO-3 empties
    # the optimizer's param_groups between sub-group steps)
    masters = [p for opt in opts for g in getattr(opt, "param_groups", []) for p in g["params"]]
    if zero is not None:
        for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat",
                     "fp32_groups_flat_partition"):
            masters += list(_tensors(getattr(zero, name, None)))
    c.add("grads", (t.grad for t in masters))  # their gradients (fp32, e.g. the offloaded or GPU-kept ones)
    c.add("grads", (p.grad for p in params))
    c.add("optimizer", iter(masters))
    for opt in opts:
        c.add("optimizer", _tensors([v for st in getattr(opt, "state", {}).values()
                                     for v in (st.values() if isinstance(st, dict) else [])]))
    if zero is not None:
        for name, value in list(vars(zero).items()):
            if "grad" in name.lower():
                c.add("grads", _tensors(value))
    return c.bytes


def record(run_dir: Path, rank: int, engine: Any, step: int) -> dict[str, Any]:
    """Measure after an optimizer step and write this rank's breakdown file (no collective). A DeepSpeed
    object this walk does not understand is recorded as an error: measuring never stops a run."""
    import torch

    out: dict[str, Any] = {"rank": rank, "step": step, "measured_after": "optimizer step"}
    try:
        states = measure(engine)
    except Exception as e:  # a new DeepSpeed layout: say so in the file, train on
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        _write(run_dir, rank, out)
        return out
    for where, cats in states.items():
        out[where] = {f"{k}_gib": v / GIB for k, v in sorted(cats.items())}
    if torch.cuda.is_available():
        gpu = out.setdefault("gpu", {})
        allocated = torch.cuda.memory_allocated() / GIB
        gpu["allocated_gib"] = allocated
        gpu["other_gib"] = allocated - _states_gib(gpu)
    _write(run_dir, rank, out)
    return out


def finish(run_dir: Path, rank: int, peaks: dict[str, float | None]) -> None:
    """At the end of the run: the run's peaks, and everything else at the GPU peak."""
    path = run_dir / "memory" / FILE.format(rank=rank)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # the run never reached an optimizer step
    peak = peaks.get("peak_allocated_gib")
    gpu = data.get("gpu")
    if peak is not None and gpu is not None:
        gpu["peak_allocated_gib"] = peak
        gpu["other_at_peak_gib"] = peak - _states_gib(gpu)
    if peaks.get("host_rss_gib") is not None:
        data.setdefault("host", {})["peak_rss_gib"] = peaks["host_rss_gib"]
    _write(run_dir, rank, data)


def _states_gib(part: dict[str, float]) -> float:
    return sum(part.get(f"{k}_gib", 0.0) for k in ("params", "grads", "optimizer"))


def _write(run_dir: Path, rank: int, data: dict[str, Any]) -> None:
    path = run_dir / "memory" / FILE.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def copy_plan(plan_path: str | None, run_dir: Path) -> str | None:
    """Rank 0: put the plan this run came from into its run directory. Returns a warning or None."""
    if not plan_path:
        return None
    src = Path(plan_path)
    if not src.is_file():
        return f"warning: train.plan={plan_path}: no such file; toolkit report will show no prediction"
    shutil.copyfile(src, run_dir / PLAN_FILE)
    return None
