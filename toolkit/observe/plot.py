"""Figures for `toolkit report`: one run (loss, tokens/s, per-rank memory with the phases marked) and
several runs overlaid.

Colours: in a one-run figure each rank has one colour (C0, C1, ...) and the run-wide series (loss,
tokens/s, which rank 0 logs for all ranks) are black, so no colour means two things. In a
comparison each run has one colour in every panel, and the line style tells ranks apart.
matplotlib with the Agg backend: headless, never opens a window, imported only when drawing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.observe.metrics import median_after_first
from toolkit.observe.rundata import PHASE_ORDER, RunData, has_gpu_data

PHASE_LABELS = {
    "model_loaded": "model loaded",
    "engine_ready": "engine ready",
    "first_step": "first step",
    "step": "steps (max)",
    "final": "final",
    "oom": "OOM",
}
RANK_STYLES = ("-", "--", ":", "-.")  # comparison figure: rank 0, 1, 2, 3
MAX_RANK_LINES = len(RANK_STYLES)  # more ranks than this: draw the max and min over ranks instead


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(plt: Any, title: str) -> tuple[Any, Any, Any, Any]:
    """Loss and tokens/s side by side (same step axis), memory below across the full width."""
    fig = plt.figure(figsize=(12, 8.5), dpi=110, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(1.0, 1.2))
    ax_loss = fig.add_subplot(grid[0, 0])
    ax_tps = fig.add_subplot(grid[0, 1], sharex=ax_loss)
    ax_mem = fig.add_subplot(grid[1, :])
    fig.suptitle(title, fontsize=12)
    for ax in (ax_loss, ax_tps, ax_mem):
        ax.grid(alpha=0.3)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_tps.set(title="throughput, all ranks", xlabel="step", ylabel="tokens/s")
    ax_tps.yaxis.set_major_formatter(_thousands())
    from matplotlib.ticker import MaxNLocator

    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared with tokens/s: steps are whole
    return fig, ax_loss, ax_tps, ax_mem


def _thousands() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v / 1000:g}k" if abs(v) >= 1000 else f"{v:g}")


def _series(data: RunData, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in data.metrics if r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_evals(ax: Any, data: RunData, color: str) -> None:
    """The held-out loss on the loss panel: dashed, with square markers, labelled once."""
    pts = [(r["step"], r["eval_loss"]) for r in data.evals if r["eval_loss"] is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, ls="--", marker="s", ms=4,
                label="eval loss (held out)")
        ax.legend(fontsize=8, loc="lower left")


def plot_preference(ax: Any, data: RunData) -> Any:
    """A preference run (train.objective): its reward accuracy on a right-hand axis of the loss panel (green), the
    held-out pairs' as squares; returns that axis, or None for a run without reward metrics."""
    pts = [(r["step"], r["rewards/accuracies"]) for r in data.metrics if r.get("rewards/accuracies") is not None]
    if not pts:
        return plot_rl(ax, data)
    acc = ax.twinx()
    acc.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:green", marker=_marker(len(pts)), ms=3,
             label="reward accuracy")
    held = [(r["step"], r["eval_rewards/accuracies"]) for r in data.evals
            if r.get("eval_rewards/accuracies") is not None]
    if held:
        acc.plot([p[0] for p in held], [p[1] for p in held], color="tab:green", ls="--", marker="s", ms=4,
                 label="reward accuracy (held out)")
    acc.set_ylim(-0.02, 1.02)
    acc.set_ylabel("reward accuracy (chosen won)", color="tab:green")
    acc.legend(fontsize=8, loc="center right")
    ax.set_title("loss and reward accuracy")
    return acc


def plot_rl(ax: Any, data: RunData) -> Any:
    """An RL run (train.objective=grpo): its mean reward on a right-hand axis of the loss panel (green); returns that
    axis, or None for a run without rewards."""
    pts = [(r["step"], r["reward"]) for r in data.metrics
           if r.get("reward") is not None and r.get("completions/mean_length") is not None]
    if not pts:
        return None
    rew = ax.twinx()
    rew.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:green", marker=_marker(len(pts)), ms=3,
             label="mean reward")
    rew.set_ylabel("mean reward", color="tab:green")
    rew.legend(fontsize=8, loc="center right")
    ax.set_title("loss and reward")
    return rew


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="gray")


def _marker(n_points: int) -> str | None:
    return "o" if n_points <= 40 else None  # dots help on a short run and blur a long one


def _peak(row: dict[str, Any]) -> float | None:
    return row["peak_allocated_gib"] if row["peak_allocated_gib"] is not None else row["allocated_gib"]


def subtitle(header: dict[str, Any]) -> str:
    """'llama-1b · ZeRO-2 · bf16 · raw path · 2 ranks' from report's header (what is known)."""
    parts = [str(header["model"])] if "model" in header else []
    if "zero stage" in header:
        parts.append(f"ZeRO-{header['zero stage']}")
    offload = [
        f"{k.split()[1]} offload to {header[k]}"
        for k in ("offload optimizer", "offload param")
        if header.get(k) not in (None, "none")
    ]
    parts += offload
    parts += [str(header["precision"])] if "precision" in header else []
    parts += [f"{header['path']} path"] if "path" in header else []
    if "world size (rank files)" in header:
        parts.append(f"{header['world size (rank files)']} ranks")
    return " · ".join(parts)


# ----------------------------------------------------------------------------- one run


def plot_run(data: RunData, name: str, path: Path) -> None:
    """One PNG: loss and tokens/s per step, and every rank's memory over time with the phases marked."""
    plt = _pyplot()
    sub = subtitle(data.header)
    fig, ax_loss, ax_tps, ax_mem = _figure(plt, name + (f"\n{sub}" if sub else ""))
    try:
        steps, loss = _series(data, "loss")
        if loss:
            ax_loss.plot(steps, loss, color="black", marker=_marker(len(loss)), ms=3)
            ax_loss.text(
                0.98,
                0.95,
                f"step {steps[0]}: {loss[0]:.4f}\nstep {steps[-1]}: {loss[-1]:.4f}",
                transform=ax_loss.transAxes,
                ha="right",
                va="top",
                fontsize=9,
            )
        else:
            _no_data(ax_loss, "no loss in metrics.jsonl")
        _plot_evals(ax_loss, data, "black")
        plot_preference(ax_loss, data)
        steps, tps = _series(data, "tokens_per_s")
        if tps:
            ax_tps.plot(steps, tps, color="black", marker=_marker(len(tps)), ms=3, label="tokens/s")
            med = median_after_first(tps)
            mfu = median_after_first([r["mfu"] for r in data.metrics])
            label = f"median after step 1: {med:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu else "")
            ax_tps.axhline(med, color="gray", ls="--", lw=1, label=label)
            ax_tps.set_ylim(bottom=0)
            ax_tps.legend(fontsize=8, loc="lower right")
        else:
            _no_data(ax_tps, "no tokens/s in metrics.jsonl")
        _memory_over_time(ax_mem, data)
        fig.savefig(path)
    finally:
        plt.close(fig)


def _memory_over_time(ax: Any, data: RunData) -> None:
    from matplotlib.lines import Line2D

    gpu = has_gpu_data(data)
    rows = [r for snaps in data.memory.values() for r in snaps]
    if not rows:
        _no_data(ax, "no memory/rank*.jsonl snapshots")
        return
    # Wall time, not step: the phases before training (model loaded, engine ready) share step 0.
    stamps = [r["ts"] for r in rows]
    on_time = all(t is not None for t in stamps)
    t0 = min(stamps) if on_time else 0.0

    def x_of(r: dict[str, Any]) -> float:
        return r["ts"] - t0 if on_time else float(r["step"])

    for rank, snaps in sorted(data.memory.items()):
        color = f"C{rank % 10}"
        snaps = sorted(snaps, key=x_of)
        key = "allocated_gib" if gpu else "host_rss_gib"
        main = [(x_of(r), r[key]) for r in snaps if r[key] is not None]
        if main:
            ax.plot(*zip(*main, strict=True), color=color, marker=_marker(len(main)), ms=4)
        if gpu:
            peaks = [(x_of(r), _peak(r)) for r in snaps if _peak(r) is not None]
            if peaks:
                # A peak covers the window since the previous snapshot: drawn as a level over it.
                ax.plot(*zip(*peaks, strict=True), color=color, ls="--", drawstyle="steps-pre")
        for r in snaps:
            if r["phase"] == "oom":
                ax.plot(
                    [x_of(r)],
                    [(r["allocated_gib"] if gpu else r["host_rss_gib"]) or 0.0],
                    "x",
                    color="red",
                    ms=10,
                    mew=2,
                )
    _mark_phases(ax, data, x_of)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the first snapshot" if on_time else "step")
    ax.set_ylabel("GiB")
    ax.set_title("per-rank GPU memory" if gpu else "per-rank host RSS (CPU run: no GPU memory)")
    handles = [
        Line2D([], [], color=f"C{rank % 10}", lw=2, label=f"rank {rank}") for rank in sorted(data.memory)
    ]
    if gpu:
        handles += [
            Line2D([], [], color="black", label="allocated"),
            Line2D([], [], color="black", ls="--", label="peak allocated since the previous snapshot"),
        ]
    # Outside the axes: memory climbs to the right, where a legend inside would cover the peak.
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _mark_phases(ax: Any, data: RunData, x_of: Any) -> None:
    """A dotted line per phase snapshot (not per periodic "step" snapshot: too many), placed by the
    lowest rank's snapshot, named on a second x axis above the panel, where the names cannot cover
    the data; phases at the same x share one name."""
    first_rank = min(data.memory)
    at: dict[float, list[str]] = {}
    for r in data.memory[first_rank]:
        if r["phase"] != "step":
            label = f"{PHASE_LABELS.get(r['phase'], r['phase'])} (step {r['step']})"
            at.setdefault(round(x_of(r), 3), []).append(label)
    for x in at:
        ax.axvline(x, color="gray", ls=":", lw=1)
    top = ax.secondary_xaxis("top")
    top.set_xticks(list(at), [" / ".join(labels) for labels in at.values()])
    top.tick_params(axis="x", labelsize=8, labelcolor="dimgray", labelrotation=25, length=0)
    for label in top.get_xticklabels():
        label.set_horizontalalignment("left")  # rotated names start at their line


# ----------------------------------------------------------------------------- several runs


def plot_compare(runs: list[tuple[str, RunData]], path: Path, title: str) -> None:
    """One PNG, runs overlaid: loss and tokens/s per step; peak memory per phase and rank."""
    plt = _pyplot()
    fig, ax_loss, ax_tps, ax_mem = _figure(plt, title)
    try:
        for i, (name, data) in enumerate(runs):
            color = f"C{i % 10}"
            steps, loss = _series(data, "loss")
            if loss:
                ax_loss.plot(steps, loss, color=color, marker=_marker(len(loss)), ms=3, label=name)
            _plot_evals(ax_loss, data, color)
            steps, tps = _series(data, "tokens_per_s")
            if tps:
                med = median_after_first(tps)
                ax_tps.plot(
                    steps,
                    tps,
                    color=color,
                    marker=_marker(len(tps)),
                    ms=3,
                    label=f"median after step 1: {med:,.0f} tokens/s",
                )
        for ax in (ax_loss, ax_tps):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="best")
        ax_tps.set_ylim(bottom=0)
        _memory_per_phase(ax_mem, runs)
        fig.savefig(path)
    finally:
        plt.close(fig)


def _memory_per_phase(ax: Any, runs: list[tuple[str, RunData]]) -> None:
    """x: the phases (runs take different times to reach them, so time would not line them up);
    y: the phase's peak per rank (GPU peak allocated, or host RSS when a run has no GPU fields)."""
    from matplotlib.lines import Line2D

    gpu = all(has_gpu_data(d) for _, d in runs)
    phases = [
        p for p in PHASE_ORDER if any(r["phase"] == p for _, d in runs for s in d.memory.values() for r in s)
    ]
    if not phases:
        _no_data(ax, "no memory/rank*.jsonl snapshots")
        return
    many = max(len(d.memory) for _, d in runs) > MAX_RANK_LINES
    for i, (_, data) in enumerate(runs):
        color = f"C{i % 10}"
        per_rank: dict[int, list[float | None]] = {}
        for rank, snaps in sorted(data.memory.items()):
            vals = []
            for p in phases:
                ys = [(_peak(r) if gpu else r["host_rss_gib"]) for r in snaps if r["phase"] == p]
                ys = [y for y in ys if y is not None]
                vals.append(max(ys) if ys else None)
            per_rank[rank] = vals
        lines = per_rank
        if many:  # max and min over ranks, phase by phase
            cols = [[v[j] for v in per_rank.values() if v[j] is not None] for j in range(len(phases))]
            lines = {0: [max(c) if c else None for c in cols], 1: [min(c) if c else None for c in cols]}
        for k, vals in lines.items():
            pts = [(j, v) for j, v in enumerate(vals) if v is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    color=color,
                    ls=RANK_STYLES[k % len(RANK_STYLES)],
                    marker="o",
                    ms=4,
                )
    ax.set_xticks(range(len(phases)), [PHASE_LABELS.get(p, p) for p in phases])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("phase")
    ax.set_ylabel("GiB")
    ax.set_title(
        "peak GPU memory allocated per phase, per rank"
        if gpu
        else "peak host RSS per phase, per rank (no GPU fields in at least one run)"
    )
    if many:
        styles = [("-", "max over ranks"), ("--", "min over ranks")]
    else:
        n = max(len(d.memory) for _, d in runs)
        styles = [(RANK_STYLES[k], f"rank {k}") for k in range(n)]
    handles = [Line2D([], [], color="black", ls=ls, label=label) for ls, label in styles]
    handles += [Line2D([], [], color=f"C{i % 10}", lw=2, label=name) for i, (name, _) in enumerate(runs)]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
