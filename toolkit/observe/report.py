"""`toolkit report RUN_DIR`: per-rank / per-phase memory tables, throughput, report.png, report.md;
`toolkit report RUN_A RUN_B ...` compares runs (toolkit/observe/compare.py).

No torch/deepspeed imports here: the report must run anywhere, fast; matplotlib loads only to plot.
Reading the run directory lives in toolkit/observe/rundata.py, the figures in toolkit/observe/plot.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.observe.metrics import median_after_first  # no torch at import: the report shares the rule
from toolkit.observe.rundata import (  # read_header and load_run are part of this module's interface
    PHASE_ORDER,
    RunData,
    has_gpu_data,
    load_run,
    read_header,
    run_dir_problem,
)
from toolkit.observe.tables import _fmt, _max, error, md_table, run_peaks

__all__ = ["build_report", "load_run", "read_header", "run_peaks", "run_report"]

PNG = "report.png"

# -- tables ------------------------------------------------------------------------------------


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
    """(markdown table, notes). Medians exclude the first logged step (compile/warm-up/allocator growth),
    the same rule as the closing summary of a run (metrics.median_after_first)."""
    m = data.metrics
    if not m:
        return "", ["no metrics.jsonl lines to summarize"]
    notes: list[str] = []
    if len(m) == 1:
        notes.append("only one metrics line: the medians include the first step")
    rows: list[list[str]] = []

    def med(key: str) -> float | None:
        return median_after_first([r[key] for r in m])

    last_loss = next((r for r in reversed(m) if r["loss"] is not None), None)
    first_loss = next((r for r in m if r["loss"] is not None), None)
    mfu = med("mfu")
    rows.append(["steps logged", f"{len(m)} (steps {m[0]['step']}..{m[-1]['step']})"])
    rows.append(["median tokens/s (excl. first step)", _fmt(med("tokens_per_s"), 1)])
    rows.append(["median MFU (excl. first step)", "-" if mfu is None else f"{100 * mfu:.1f}%"])
    rows.append(["median samples/s (excl. first step)", _fmt(med("samples_per_s"), 2)])
    rows.append(["median step time s (excl. first step)", _fmt(med("step_time_s"), 3)])
    waste = med("padding_waste")
    rows.append(["padding (pad / computed positions)", "-" if waste is None else f"{100 * waste:.1f}%"])
    rows.append(
        ["first loss", "-" if first_loss is None else f"{first_loss['loss']:.4f} (step {first_loss['step']})"]
    )
    rows.append(
        ["final loss", "-" if last_loss is None else f"{last_loss['loss']:.4f} (step {last_loss['step']})"]
    )
    ev = [r for r in data.evals if r["eval_loss"] is not None]
    if ev:
        rows.append(["first eval loss", f"{ev[0]['eval_loss']:.4f} (step {ev[0]['step']})"])
        if ev[-1].get("eval_pairs") is not None:  # held-out preference pairs
            rows.append(["final eval loss (accuracy)", f"{ev[-1]['eval_loss']:.4f} "
                         f"({_fmt(ev[-1]['eval_rewards/accuracies'], 3)}, step {ev[-1]['step']})"])
        else:
            rows.append(["final eval loss (perplexity)",
                         f"{ev[-1]['eval_loss']:.4f} ({_fmt(ev[-1]['eval_ppl'], 2)}, step {ev[-1]['step']})"])
    pref = [r for r in m if r.get("rewards/accuracies") is not None]
    if pref:  # a preference run: TRL's reward metrics, first and last logged
        a, b = pref[0], pref[-1]
        rows.append(["preference accuracy", f"{a['rewards/accuracies']:.3f} (step {a['step']}) -> "
                                            f"{b['rewards/accuracies']:.3f} (step {b['step']})"])
        rows.append(["reward margin", f"{_fmt(a.get('rewards/margins'), 4)} -> {_fmt(b.get('rewards/margins'), 4)}"])
    for g in data.generations:
        match = "" if g["gen_exact_match"] is None else f", exact match {g['gen_exact_match']:.3f}"
        rows.append([f"generate (step {g['step']})",
                     f"{_fmt(g['gen_prompts'], 0)} prompts, {_fmt(g['gen_new_tokens'], 0)} new tokens, "
                     f"{_fmt(g['gen_tokens_per_s'], 1)} tokens/s, {g['gen_path'] or '-'}{match}"])
    elapsed = next((r["elapsed_s"] for r in reversed(m) if r["elapsed_s"] is not None), None)
    rows.append(["elapsed s", _fmt(elapsed, 1)])
    if mfu is None:
        notes.append(
            "MFU: not recorded (CPU or fp32 run, a GPU without a known peak "
            "(set metrics.peak_tflops), or a run from before MFU logging)"
        )
    return md_table(["metric", "value"], rows, left=2), notes


def experts_summary(data: RunData) -> str | None:
    """Mixture-of-Experts runs: the load-balancing loss and each MoE layer's expert load (the busiest expert's
    tokens over the mean: 1.0 is balanced, experts / top-k when one expert gets every token), first
    and last logged step and the run's worst; None for a run that logged neither."""
    rows = [r for r in data.metrics if "moe_aux_loss" in r]
    if not rows:
        return None
    aux = [r["moe_aux_loss"] for r in rows if r["moe_aux_loss"] is not None]
    lines = [f"load-balancing loss (moe_aux_loss): first {_fmt(aux[0] if aux else None, 4)}, "
             f"final {_fmt(aux[-1] if aux else None, 4)}, median excl. first "
             f"{_fmt(median_after_first([r['moe_aux_loss'] for r in rows]), 4)}"]
    loads = [(r["step"], r["expert_load"]) for r in rows if r.get("expert_load")]
    if not loads:
        return "\n".join([*lines, "expert load: not logged"])
    table = []
    for layer in range(len(loads[0][1])):
        seq = [(step, load[layer]) for step, load in loads if layer < len(load) and load[layer] is not None]
        if seq:
            worst = max(seq, key=lambda x: x[1])
            table.append([str(layer), _fmt(seq[0][1], 2), _fmt(seq[-1][1], 2), f"{_fmt(worst[1], 2)} (step {worst[0]})"])
    lines.append(f"expert load per MoE layer (busiest expert's tokens / mean; 1.0 = balanced), "
                 f"steps {loads[0][0]}..{loads[-1][0]}:")
    return "\n".join([*lines, md_table(["layer", "first", "final", "max"], table, left=1)])


# -- entry point -------------------------------------------------------------------------------


def build_report(data: RunData, run_name: str, png: str | None,
                 extra: list[tuple[str, str]] | None = None) -> tuple[str, str]:
    """(terminal text, markdown). Same tables in both; the markdown embeds the figure by a relative
    link, so the report travels with the run directory. ``extra``: (title, body) sections after memory."""
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
    sections += extra or []
    thr, thr_notes = throughput_summary(data)
    sections.append(("Throughput", "\n".join(filter(None, [thr, *thr_notes]))))
    experts = experts_summary(data)
    if experts:
        sections.append(("Mixture-of-Experts", experts))
    skipped = [f"- {s}" for s in data.skipped] + [f"- {s} (line kept)" for s in data.partial]
    summary = f"{len(data.skipped)} line(s) skipped, {len(data.partial)} kept with missing fields"
    sections.append(("Skipped", "\n".join([summary, *skipped]) if skipped else "nothing skipped"))

    text = "\n\n".join(f"== {title} ==\n{body}" for title, body in sections)
    md = [f"# Run report: {run_name}", ""]
    if png:
        md += [f"![loss, tokens/s and per-rank memory]({png})", ""]
    for title, body in sections:
        md += [f"## {title}", "", body, ""]
    return text, "\n".join(md)


def _breakdown_sections(run_dir: Path) -> list[tuple[str, str]]:
    """Per-rank memory by category (memory/breakdown_rank*.json), and the plan's prediction beside it
    when the run came from `toolkit plan -o` (plan.json)."""
    from toolkit.observe.plan_vs_run import measured_breakdown_table, plan_vs_measured

    out = []
    vs = plan_vs_measured(run_dir)
    if vs:
        out.append(("Predicted (toolkit plan) vs measured, per rank", vs))
    measured = measured_breakdown_table(run_dir)
    if measured:
        out.append(("Memory by category after the first optimizer step, per rank (GiB)", measured))
    return out


def run_report(args: Any) -> int:
    """`toolkit report RUN_DIR [RUN_DIR ...] [-o OUT] [--force]`: one run, or a comparison of several."""
    run_dirs = [Path(d) for d in args.run_dirs]
    for d in run_dirs:
        problem = run_dir_problem(d)
        if problem:
            return error(problem)
    if len(run_dirs) > 1:
        from toolkit.observe.compare import run_compare

        return run_compare(run_dirs, Path(args.output or "."), force=bool(getattr(args, "force", False)))
    run_dir = run_dirs[0]
    data = load_run(run_dir)
    if not any(data.memory.values()) and not data.metrics:
        first = f" (first: {data.skipped[0]})" if data.skipped else ""
        return error(
            f"nothing to report in {run_dir}: no readable line in memory/rank*.jsonl or metrics.jsonl, "
            f"{len(data.skipped)} skipped{first}"
        )
    out_dir = Path(args.output or run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from toolkit.observe.plot import plot_run

    name = run_dir.resolve().name
    plot_run(data, name, out_dir / PNG)
    text, md = build_report(data, name, PNG, _breakdown_sections(run_dir))
    (out_dir / "report.md").write_text(md)
    print(text)
    print(f"\nwrote {out_dir / 'report.md'} and {out_dir / PNG}")
    return 0
