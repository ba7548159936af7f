"""`toolkit report RUN_A RUN_B [...]`: runs side by side.

Two tables (the settings that differ, from each run's config.yaml, ds_config.json and
versions.json; and per run: median tokens/s, MFU, per-rank peak memory, final loss) and one PNG with
the runs overlaid, written as compare.md and compare.png. Runs of different models or data measure
different workloads, not settings, so they are refused with one line unless --force.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.observe.metrics import median_after_first
from toolkit.observe.rundata import RunData, has_gpu_data, load_run, settings
from toolkit.observe.tables import error, md_table, run_peaks

# Same model and same data, or the comparison is between workloads (refused without --force).
WORKLOAD_KEYS = ("model.name", "model.task", "data.source", "data.seq_len", "data.packing")
# Settings a run resolves (versions.json): compared as they ran, so data.packing auto and true that both packed agree.
RESOLVED = {"data.packing": "versions: packing"}
# Differs between any two runs and says nothing about how they trained.
IGNORED_KEYS = ("train.run_dir",)
MAX_CELL = 60  # long values (liger_note) are cut in the table; the files keep them whole
PNG, MD = "compare.png", "compare.md"


@dataclass
class Run:
    name: str
    path: Path
    data: RunData
    settings: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # settings files missing or unreadable


def _names(paths: list[Path]) -> list[str]:
    """Directory names; the parent too where two runs share a name (runs/a/x vs runs/b/x)."""
    names = [p.resolve().name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    return names


def load_runs(paths: list[Path]) -> list[Run]:
    runs = []
    for name, path in zip(_names(paths), paths, strict=True):
        found, problems = settings(path)
        runs.append(Run(name, path, load_run(path), found, problems))
    return runs


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def workload_mismatch(runs: list[Run]) -> str | None:
    """Why the runs may not be the same workload, as a clause for one error line; None when they are."""
    for run in runs:
        if "model.name" not in run.settings:
            return (
                f"cannot check that these runs train the same model and data ({run.path} has no readable "
                "config.yaml)"
            )
    diffs = []
    for key in WORKLOAD_KEYS:
        values = [_cell(run.settings.get(RESOLVED.get(key, key), run.settings.get(key, "(absent)"))) for run in runs]
        if len(set(values)) > 1:
            diffs.append(f"{key}: {' vs '.join(values)}")
    return f"these runs train different models or data ({'; '.join(diffs)})" if diffs else None


def settings_diff(runs: list[Run]) -> list[list[str]]:
    """Rows [setting, value in run 1, value in run 2, ...] for every setting whose values differ,
    in file order (config.yaml, then ds_config.json, then versions.json); '(absent)' where a run lacks it."""
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(run.settings))
    order = {key: i for i, key in enumerate(keys)}

    def group(key: str) -> int:  # a key found only in a later run stays beside its own file's keys
        return 1 if key.startswith("ds_config: ") else 2 if key.startswith("versions: ") else 0

    rows = []
    for key in sorted(keys, key=lambda k: (group(k), order[k])):
        if key in IGNORED_KEYS:
            continue
        cells = [_cell(run.settings[key]) if key in run.settings else "(absent)" for run in runs]
        if len(set(cells)) > 1:
            rows.append([key, *cells])
    return rows


def summary_rows(runs: list[Run]) -> list[list[str]]:
    """Per run: steps, median tokens/s (after step 1) and its ratio to the first run, MFU, per-rank
    peak memory (GPU peak allocated, or host RSS on a CPU run) and the final loss."""
    rows = []
    base = None
    for i, run in enumerate(runs):
        m = run.data.metrics
        tps = median_after_first([r["tokens_per_s"] for r in m])
        mfu = median_after_first([r["mfu"] for r in m])
        if i == 0:
            base = tps
        ratio = "-" if tps is None or not base else f"{tps / base:.2f}x"
        final = next((r for r in reversed(m) if r["loss"] is not None), None)
        gpu = has_gpu_data(run.data)
        key = "peak_allocated_gib" if gpu else "host_rss_gib"
        peaks = [p[key] for p in run_peaks(run.data).values()]
        peak = " / ".join("-" if v is None else f"{v:.2f}" for v in peaks)
        rows.append(
            [
                run.name,
                f"{m[-1]['step']}" if m else "-",
                "-" if tps is None else f"{tps:,.0f}",
                ratio,
                "-" if mfu is None else f"{100 * mfu:.1f}%",
                f"{peak} ({'allocated' if gpu else 'host RSS'})" if peaks else "-",
                "-" if final is None else f"{final['loss']:.4f}",
            ]
        )
    return rows


SUMMARY_HEADERS = [
    "run",
    "last step",
    "median tokens/s",
    "vs first",
    "MFU",
    "peak GiB per rank (0 / 1 / ...)",
    "final loss",
]


def build_compare(runs: list[Run], forced: str | None) -> tuple[str, str]:
    """(terminal text, markdown)."""
    diff = settings_diff(runs)
    sections = []
    if forced:
        sections.append(("Warning", f"compared with --force: {forced}"))
    sections.append(
        (
            "Settings that differ",
            md_table(["setting", *(r.name for r in runs)], diff, left=len(runs) + 1)
            if diff
            else "no settings differ",
        )
    )
    sections.append(("Results", md_table(SUMMARY_HEADERS, summary_rows(runs))))
    notes = [
        "tokens/s and MFU: medians over the logged steps after the first (compile and warm-up land in "
        "step 1); tokens/s counts real tokens of all ranks"
    ]
    if all(median_after_first([r["mfu"] for r in run.data.metrics]) is None for run in runs):
        notes.append(
            "MFU: not recorded in these runs (CPU or fp32, a GPU without a known peak, or runs from "
            "before MFU logging)"
        )
    notes += [f"{run.name}: {p}" for run in runs for p in run.problems]
    notes += [
        f"{run.name}: {len(run.data.skipped)} line(s) skipped (toolkit report {run.path} names them)"
        for run in runs
        if run.data.skipped
    ]
    sections.append(("Notes", "\n".join(f"- {n}" for n in notes)))
    text = "\n\n".join(f"== {title} ==\n{body}" for title, body in sections)
    md = [f"# Runs compared: {', '.join(r.name for r in runs)}", "", f"![runs overlaid]({PNG})", ""]
    for title, body in sections:
        md += [f"## {title}", "", body, ""]
    return text, "\n".join(md)


def run_compare(paths: list[Path], out_dir: Path, force: bool) -> int:
    runs = load_runs(paths)
    empty = [r for r in runs if not r.data.metrics and not any(r.data.memory.values())]
    if empty:
        return error(
            f"nothing to compare in {empty[0].path}: no readable line in metrics.jsonl or memory/rank*.jsonl"
        )
    mismatch = workload_mismatch(runs)
    if mismatch and not force:
        return error(
            f"{mismatch}: their numbers would compare workloads, not settings; pass --force to "
            "compare them anyway"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    from toolkit.observe.plot import plot_compare

    models = {str(r.settings.get("model.name")) for r in runs}
    title = f"{len(runs)} runs compared" + (f": {models.pop()}" if len(models) == 1 else "")
    plot_compare([(r.name, r.data) for r in runs], out_dir / PNG, title)
    text, md = build_compare(runs, mismatch)
    (out_dir / MD).write_text(md)
    print(text)
    print(f"\nwrote {out_dir / MD} and {out_dir / PNG}")
    return 0
