"""`toolkit report RUN_DIR`: per-rank / per-phase memory tables, throughput, memory.png, report.md.

Reads only files inside the run directory, by relative path, so a run dir copied from another
machine works. Bad lines (truncated, not JSON, missing fields) are skipped and named, never fatal.
No torch/deepspeed imports here: the report must run anywhere, fast; matplotlib loads only to plot.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit import ds_config as dc

PHASE_ORDER = ("model_loaded", "engine_ready", "first_step", "step", "final", "oom")
GPU_KEYS = ("allocated_gib", "reserved_gib", "peak_allocated_gib", "peak_reserved_gib", "nvml_used_gib")
MEMORY_REQUIRED = ("phase", "step")
NUMERIC_MEMORY = (*GPU_KEYS, "host_rss_gib", "alloc_retries", "oom_count")
METRIC_KEYS = ("loss", "lr", "tokens_per_s", "samples_per_s", "step_time_s", "grad_norm", "elapsed_s")


@dataclass
class RunData:
    memory: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> snapshots in file order
    metrics: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "file:line: why" for lines not used
    partial: list[str] = field(default_factory=list)  # "file:line: missing x" for lines used in part
    header: dict[str, Any] = field(default_factory=dict)


def _num(value: Any) -> float | None:
    # bool is an int in Python; a true/false where a number belongs is bad data, not 1/0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _read_jsonl(path: Path, label: str, skipped: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse a JSONL file line by line; bad lines go to ``skipped`` as 'label:lineno: why'."""
    try:
        raw = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        skipped.append(f"{label}: unreadable ({e.strerror or e})")
        return []
    lines = raw.split("\n")
    ends_with_newline = raw.endswith("\n")
    if ends_with_newline:
        lines.pop()  # the empty string after the final newline
    out: list[tuple[int, dict[str, Any]]] = []
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            last = i == len(lines) and not ends_with_newline
            why = (
                "truncated last line (no newline; the writer probably died mid-write)"
                if last
                else f"not JSON ({e.msg} at column {e.colno})"
            )
            skipped.append(f"{label}:{i}: {why}")
            continue
        if not isinstance(obj, dict):
            skipped.append(f"{label}:{i}: not a JSON object ({type(obj).__name__})")
            continue
        out.append((i, obj))
    return out


def _rank_of(path: Path) -> int | None:
    m = re.fullmatch(r"rank(\d+)\.jsonl", path.name)
    return int(m.group(1)) if m else None


def load_run(run_dir: Path) -> RunData:
    data = RunData()
    mem_dir = run_dir / "memory"
    files = sorted((p for p in mem_dir.glob("rank*.jsonl") if _rank_of(p) is not None), key=_rank_of)
    for path in files:
        rank = _rank_of(path)
        assert rank is not None
        label = f"memory/{path.name}"
        rows: list[dict[str, Any]] = []
        for i, obj in _read_jsonl(path, label, data.skipped):
            missing = [k for k in MEMORY_REQUIRED if k not in obj]
            if missing or not isinstance(obj.get("phase"), str) or _num(obj.get("step")) is None:
                why = f"missing field {', '.join(missing)}" if missing else "phase/step of the wrong type"
                data.skipped.append(f"{label}:{i}: {why}")
                continue
            # The file name is the authority on the rank: a copied/renamed file still reports right.
            row: dict[str, Any] = {"phase": obj["phase"], "step": int(obj["step"]), "rank": rank}
            absent = [k for k in (*NUMERIC_MEMORY, "device") if k not in obj]
            for k in NUMERIC_MEMORY:
                row[k] = _num(obj.get(k))
            row["device"] = obj.get("device")
            if absent:
                data.partial.append(f"{label}:{i}: missing {', '.join(absent)} (shown as -)")
            rows.append(row)
        data.memory[rank] = rows

    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        for i, obj in _read_jsonl(metrics_path, "metrics.jsonl", data.skipped):
            if _num(obj.get("step")) is None:
                data.skipped.append(f"metrics.jsonl:{i}: missing field step")
                continue
            row = {"step": int(obj["step"]), **{k: _num(obj.get(k)) for k in METRIC_KEYS}}
            data.metrics.append(row)
        data.metrics.sort(key=lambda r: r["step"])
    data.header = read_header(run_dir, world_size_files=len(files), skipped=data.skipped)
    return data


def read_header(run_dir: Path, world_size_files: int, skipped: list[str]) -> dict[str, Any]:
    """Stage, offload, precision, world size and path from ds_config.json / config.yaml, when readable."""
    h: dict[str, Any] = {}
    ds_path = run_dir / "ds_config.json"
    if ds_path.is_file():
        try:
            ds = json.loads(ds_path.read_text())
            zero = ds.get("zero_optimization") or {}
            h["zero stage"] = dc.zero_stage(ds)
            for key in ("offload_optimizer", "offload_param"):
                dev = (zero.get(key) or {}).get("device", "none")
                h[key.replace("_", " ")] = dev
            h["precision"] = dc.precision_of(ds) or "fp32"  # resolved: no "auto" left
            if h["precision"] == "fp32" and (ds.get("torch_autocast") or {}).get("enabled") is True:
                h["precision"] = f"torch autocast {ds['torch_autocast'].get('dtype', 'bfloat16')}"
            tbs, mbs = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
            gas = ds.get("gradient_accumulation_steps", 1)
            if all(isinstance(v, int) and v > 0 for v in (tbs, mbs, gas)):
                h["train batch size"] = f"{tbs} (micro {mbs} x accum {gas} x dp {tbs // (mbs * gas)})"
        except (OSError, ValueError, AttributeError) as e:
            skipped.append(f"ds_config.json: unreadable ({e})")
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml

            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            train, model = cfg.get("train") or {}, cfg.get("model") or {}
            h["path"] = train.get("path")
            h["model"] = model.get("name")
            # ds_config.json holds what ran; the training config's precision is only the fallback.
            h.setdefault("precision", train.get("precision"))
        except Exception as e:
            skipped.append(f"config.yaml: unreadable ({e})")
    if world_size_files:
        h["world size (rank files)"] = world_size_files
    return {k: v for k, v in h.items() if v is not None}


# -- tables ------------------------------------------------------------------------------------


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _max(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def md_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A Markdown pipe table, also readable as plain text: the first ``left`` columns (labels)
    align left, the rest (numbers) right."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    sep = (
        "|"
        + "|".join(":" + "-" * (w + 1) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _stat_rows(cols: list[list[float | None]], digits: int = 2) -> list[list[str]]:
    """max/min/spread over ranks for each column (None values ignored)."""
    out = {"max": ["max"], "min": ["min"], "spread": ["spread"]}
    for col in cols:
        vals = [v for v in col if v is not None]
        hi, lo = (max(vals), min(vals)) if vals else (None, None)
        out["max"].append(_fmt(hi, digits))
        out["min"].append(_fmt(lo, digits))
        out["spread"].append(_fmt(None if hi is None else hi - lo, digits))
    return list(out.values())


def has_gpu_data(data: RunData) -> bool:
    return any(r.get(k) is not None for rows in data.memory.values() for r in rows for k in GPU_KEYS)


def per_rank_table(data: RunData) -> str:
    headers = [
        "rank",
        "peak alloc",
        "peak reserved",
        "max nvml used",
        "max host rss",
        "retries",
        "ooms",
        "snapshots",
    ]
    rows, cols = [], [[] for _ in range(5)]
    for rank, snaps in sorted(data.memory.items()):
        # A snapshot's peak covers the window since the previous one, so the run's peak is the max.
        vals = [
            _max(
                [
                    r["peak_allocated_gib"] if r["peak_allocated_gib"] is not None else r["allocated_gib"]
                    for r in snaps
                ]
            ),
            _max(
                [
                    r["peak_reserved_gib"] if r["peak_reserved_gib"] is not None else r["reserved_gib"]
                    for r in snaps
                ]
            ),
            _max([r["nvml_used_gib"] for r in snaps]),
            _max([r["host_rss_gib"] for r in snaps]),
            _max([r["alloc_retries"] for r in snaps]),  # cumulative counter: last == max
        ]
        ooms = _max([r["oom_count"] for r in snaps])
        n_oom_phase = sum(r["phase"] == "oom" for r in snaps)
        for c, v in zip(cols, vals, strict=True):
            c.append(v)
        rows.append(
            [
                str(rank),
                *(_fmt(v) for v in vals[:4]),
                _fmt(vals[4], 0),
                _fmt(max(ooms or 0, n_oom_phase), 0),
                str(len(snaps)),
            ]
        )
    stats = _stat_rows(cols[:4])
    stats = [[*s, "", "", ""] for s in stats]
    return md_table(headers, rows + stats)


def per_phase_table(data: RunData, key: str, fallback: str | None = None) -> str:
    """Rows: ranks (+max/min/spread); columns: phases present; cell: max of ``key`` over that phase."""
    phases = [p for p in PHASE_ORDER if any(r["phase"] == p for rows in data.memory.values() for r in rows)]
    extra = sorted({r["phase"] for rows in data.memory.values() for r in rows} - set(PHASE_ORDER))
    phases += extra
    rows, cols = [], [[] for _ in phases]
    for rank, snaps in sorted(data.memory.items()):
        cells = []
        for j, p in enumerate(phases):
            vals = [
                r[key] if r[key] is not None or fallback is None else r[fallback]
                for r in snaps
                if r["phase"] == p
            ]
            v = _max(vals)
            cols[j].append(v)
            cells.append(_fmt(v))
        rows.append([str(rank), *cells])
    return md_table(["rank", *phases], rows + _stat_rows(cols))


def throughput_summary(data: RunData) -> tuple[str, list[str]]:
    """(markdown table, notes). Medians exclude the first logged step (compile/warm-up/allocator growth)."""
    m = data.metrics
    if not m:
        return "", ["no metrics.jsonl lines to summarize"]
    notes: list[str] = []
    body = m[1:] if len(m) > 1 else m
    if len(m) == 1:
        notes.append("only one metrics line: the medians include the first step")
    rows: list[list[str]] = []

    def med(key: str) -> float | None:
        vals = [r[key] for r in body if r[key] is not None]
        return statistics.median(vals) if vals else None

    last_loss = next((r for r in reversed(m) if r["loss"] is not None), None)
    first_loss = next((r for r in m if r["loss"] is not None), None)
    rows.append(["steps logged", f"{len(m)} (steps {m[0]['step']}..{m[-1]['step']})"])
    rows.append(["median tokens/s (excl. first step)", _fmt(med("tokens_per_s"), 1)])
    rows.append(["median samples/s (excl. first step)", _fmt(med("samples_per_s"), 2)])
    rows.append(["median step time s (excl. first step)", _fmt(med("step_time_s"), 3)])
    rows.append(
        ["first loss", "-" if first_loss is None else f"{first_loss['loss']:.4f} (step {first_loss['step']})"]
    )
    rows.append(
        ["final loss", "-" if last_loss is None else f"{last_loss['loss']:.4f} (step {last_loss['step']})"]
    )
    elapsed = next((r["elapsed_s"] for r in reversed(m) if r["elapsed_s"] is not None), None)
    rows.append(["elapsed s", _fmt(elapsed, 1)])
    return md_table(["metric", "value"], rows, left=2), notes


# -- plot --------------------------------------------------------------------------------------


def plot_memory(data: RunData, path: Path) -> str:
    """Write memory.png; returns what was plotted. Agg backend: works headless, never opens a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = has_gpu_data(data)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    try:
        for rank, snaps in sorted(data.memory.items()):
            color = f"C{rank % 10}"
            # Stable sort by step: phase snapshots sharing a step keep their time order, and a
            # resumed run (which appends from an earlier step) does not draw a zigzag back in time.
            snaps = sorted(snaps, key=lambda r: r["step"])
            if gpu:
                pts = [(r["step"], r["allocated_gib"]) for r in snaps if r["allocated_gib"] is not None]
                peaks = [
                    (r["step"], r["peak_allocated_gib"]) for r in snaps if r["peak_allocated_gib"] is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), color=color, marker=".", label=f"rank {rank} allocated")
                if peaks:
                    ax.plot(
                        *zip(*peaks, strict=True), color=color, ls="--", label=f"rank {rank} peak allocated"
                    )
            else:
                pts = [(r["step"], r["host_rss_gib"]) for r in snaps if r["host_rss_gib"] is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), color=color, marker=".", label=f"rank {rank} host RSS")
            ooms = [r for r in snaps if r["phase"] == "oom"]
            for r in ooms:
                y = r["allocated_gib"] if gpu else r["host_rss_gib"]
                ax.plot([r["step"]], [y or 0.0], "x", color="red", ms=10, mew=2)
        what = "allocated / peak allocated" if gpu else "host RSS (no GPU fields: CPU run)"
        ax.set_title(f"per-rank memory: {what}")
        ax.set_xlabel("step")
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2, loc="best")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return what


# -- entry point -------------------------------------------------------------------------------


def build_report(data: RunData, run_name: str, plotted: str | None) -> tuple[str, str]:
    """(terminal text, markdown). Same tables in both; the markdown embeds memory.png."""
    sections: list[tuple[str, str]] = []
    if data.header:
        sections.append(
            ("Run", md_table(["setting", "value"], [[k, str(v)] for k, v in data.header.items()], left=2))
        )
    if data.memory:
        gpu = has_gpu_data(data)
        sections.append(("Per-rank memory (GiB, whole run)", per_rank_table(data)))
        if gpu:
            sections.append(
                (
                    "Peak allocated per phase (GiB)",
                    per_phase_table(data, "peak_allocated_gib", "allocated_gib"),
                )
            )
            sections.append(
                ("Peak reserved per phase (GiB)", per_phase_table(data, "peak_reserved_gib", "reserved_gib"))
            )
        else:
            sections.append(
                ("Host RSS per phase (GiB; no GPU fields: CPU run)", per_phase_table(data, "host_rss_gib"))
            )
    else:
        sections.append(("Memory", "no memory/rank*.jsonl snapshots"))
    thr, thr_notes = throughput_summary(data)
    sections.append(("Throughput", "\n".join(filter(None, [thr, *thr_notes]))))
    skipped = [f"- {s}" for s in data.skipped] + [f"- {s} (line kept)" for s in data.partial]
    summary = f"{len(data.skipped)} line(s) skipped, {len(data.partial)} kept with missing fields"
    sections.append(("Skipped", "\n".join([summary, *skipped]) if skipped else "nothing skipped"))

    text = "\n\n".join(f"== {title} ==\n{body}" for title, body in sections)
    md = [f"# Run report: {run_name}", ""]
    if plotted:
        md += [f"![per-rank memory: {plotted}](memory.png)", ""]
    for title, body in sections:
        md += [f"## {title}", "", body, ""]
    return text, "\n".join(md)


def run_report(args: Any) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(
            f"error: run directory {run_dir} does not exist (expected memory/rank*.jsonl and metrics.jsonl inside)",
            file=sys.stderr,
        )
        return 1
    data = load_run(run_dir)
    if not data.memory and not data.metrics:
        print(
            f"error: nothing to report in {run_dir}: no readable memory/rank*.jsonl or metrics.jsonl lines",
            file=sys.stderr,
        )
        for s in data.skipped:
            print(f"  skipped {s}", file=sys.stderr)
        return 1
    out_dir = Path(getattr(args, "output", None) or run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plotted = None
    if any(data.memory.values()):
        plotted = plot_memory(data, out_dir / "memory.png")
    text, md = build_report(data, run_dir.resolve().name, plotted)
    (out_dir / "report.md").write_text(md)
    print(text)
    print(f"\nwrote {out_dir / 'report.md'}" + (f" and {out_dir / 'memory.png'}" if plotted else ""))
    return 0
