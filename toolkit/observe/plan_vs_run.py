"""`toolkit report`'s "predicted vs measured" section, for a run that came from `toolkit plan -o`.

Reads run_dir/plan.json (copied there by train.py from train.plan) and memory/breakdown_rank{N}.json
(toolkit/observe/breakdown.py). No torch: the report runs anywhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROWS = (  # (label, plan key in persistent_gib / computed, breakdown key in "gpu")
    ("parameters (GPU)", "params", "params_gib"),
    ("gradients (GPU)", "grads", "grads_gib"),
    ("optimizer states (GPU)", "optimizer", "optimizer_gib"),
    ("everything else at the peak (GPU)", "other", "other_at_peak_gib"),
    ("peak allocated (GPU)", "peak", "peak_allocated_gib"),
)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _breakdowns(run_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for f in (run_dir / "memory").glob("breakdown_rank*.json"):
        m = re.fullmatch(r"breakdown_rank(\d+)\.json", f.name)
        data = _read(f) if m else None
        if m and data is not None:
            out[int(m.group(1))] = data
    return dict(sorted(out.items()))


def measured_breakdown_table(run_dir: Path) -> str | None:
    """Per rank: parameters, gradients, optimizer states and everything else at the peak (GiB)."""
    from toolkit.observe.tables import md_table

    ranks = _breakdowns(run_dir)
    if not ranks:
        return None
    rows = []
    for where in ("gpu", "host"):
        for label, key in (("parameters", "params_gib"), ("gradients", "grads_gib"), ("optimizer states", "optimizer_gib"),
                           ("everything else at the peak", "other_at_peak_gib"), ("peak allocated", "peak_allocated_gib"),
                           ("peak RSS", "peak_rss_gib")):
            vals = [(b.get(where) or {}).get(key) for b in ranks.values()]
            if any(v is not None for v in vals):
                rows.append([f"{label} ({where})", *("-" if v is None else f"{v:.2f}" for v in vals)])
    return md_table(["GiB", *(f"rank {r}" for r in ranks)], rows)


def plan_vs_measured(run_dir: Path) -> str | None:
    """The plan's per-rank prediction beside each rank's measurement, or None without a plan.json."""
    from toolkit.observe.tables import md_table

    plan = _read(run_dir / "plan.json")
    if plan is None or not isinstance(plan.get("chosen"), dict):
        return None
    chosen = plan["chosen"]
    persistent = chosen.get("persistent_gib") or {}
    peak = chosen.get("gpu_peak_gib")
    predicted = dict(persistent)
    if peak is not None:
        predicted["peak"] = peak
        predicted["other"] = peak - sum(persistent.get(k, 0.0) for k in ("params", "grads", "optimizer"))
    ranks = _breakdowns(run_dir)
    rows = []
    for label, pkey, mkey in ROWS:
        pred = predicted.get(pkey)
        vals = [(b.get("gpu") or {}).get(mkey) for b in ranks.values()]
        rows.append([label, _f(pred), *(_f(v) for v in vals), _err(pred, vals)])
    host_pred = chosen.get("host_rank_gib")
    host_vals = [(b.get("host") or {}).get("peak_rss_gib") for b in ranks.values()]
    rows.append(["host RSS, peak", _f(host_pred), *(_f(v) for v in host_vals), _err(host_pred, host_vals)])
    table = md_table(["GiB per rank", "predicted", *(f"rank {r}" for r in ranks), "worst error"], rows)
    notes = [f"plan: `{plan.get('command', '?')}`", f"chosen: {_describe(chosen)}"]
    notes += _mismatches(run_dir, plan)
    if not any((b.get("gpu") or {}).get("peak_allocated_gib") is not None for b in ranks.values()):
        notes.append("no GPU measurement (a CPU run, or the run never reached an optimizer step): the plan "
                     "predicts a GPU run")
    return table + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _f(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v:.2f}"


def _err(pred: Any, vals: list[Any]) -> str:
    nums = [v for v in vals if isinstance(v, (int, float))]
    if not isinstance(pred, (int, float)) or not nums:
        return "-"
    worst = max(nums, key=lambda v: abs(pred - v))
    if abs(worst) < 0.01:
        return "-" if abs(pred) < 0.01 else "n/a"
    return f"{100 * (pred - worst) / worst:+.1f}%"


def _describe(c: dict[str, Any]) -> str:
    off = c.get("offload", "none")
    if off != "none" and c.get("offload_ratio") not in (None, 1.0):
        off += f" (ratio {c['offload_ratio']:g})"
    return (f"ZeRO-{c.get('stage')}, offload {off}, micro {c.get('micro_batch')} x accum {c.get('grad_accum')}, "
            f"checkpointing {'on' if c.get('grad_ckpt') else 'off'}")


def _mismatches(run_dir: Path, plan: dict[str, Any]) -> list[str]:
    """Settings where this run differs from the plan: then the prediction is for another configuration."""
    out: list[str] = []
    chosen = plan["chosen"]
    ds = _read(run_dir / "ds_config.json") or {}
    zero = ds.get("zero_optimization") or {}
    if zero and int(zero.get("stage", 0)) != chosen.get("stage"):
        out.append(f"this run used ZeRO-{zero.get('stage')}, the plan ZeRO-{chosen.get('stage')}")
    for key, want in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        if key in ds and ds[key] != chosen.get(want):
            out.append(f"this run's {key} is {ds[key]}, the plan's {chosen.get(want)}")
    world = (plan.get("inputs") or {}).get("world_size")
    n_files = len(list((run_dir / "memory").glob("rank*.jsonl")))
    if world and n_files and n_files != world:
        out.append(f"this run had {n_files} ranks, the plan {world}")
    if out:
        out.insert(0, "**the run differs from the plan, so the prediction is for another configuration:**")
    return out
