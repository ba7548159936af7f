"""`toolkit plan --max-seq`: the longest sequence each choice fits, from the same predictions as `toolkit plan`.

For every stage x offload x micro-batch x checkpointing choice the global batch allows, the sequence length
doubles from one step (1,024 x the sequence-parallel degree, so every rank's slice is whole) while the choice
fits, then is bisected to one step. model.tiled_mlp=auto is resolved at each length, as a run would. The
model's positions cap the search (--rope-factor raises them).

Two lengths per choice: the longest that fits as `toolkit plan` plans (the predicted peak plus the allocator
margin, ALLOC_MARGIN, within the GPU), and the edge: the predicted limit with no margin, the longest whose
predicted peak alone fits. Between the two a run trains as far as fragmentation lets it. Measured on llama-3.2-1b
with LoRA under a 24 GiB cap (bench/results/long_seq/max_seq_probe.md): with PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True the longest length that trained was one step below the edge at SP=1 and SP=2; with
torch's default segments, 2 and 5 steps below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from toolkit.plan import planner as pl
from toolkit.plan.speedups import tiled_mlp_on

NO_POSITIONS_CAP = 1 << 24
"""The search's end for a model without a position limit (16M tokens)."""


@dataclass
class Longest:
    prediction: pl.Prediction
    """The choice at its longest length."""
    seq_len: int
    capped: bool
    """The model's positions stopped the search, not memory."""
    edge: int = 0
    """The longest length whose predicted peak fits the GPU with no allocator margin (>= seq_len)."""


def search(w: pl.Workload, hw: pl.Hardware, tiled_setting: str, **limits: Any) -> list[Longest]:
    """Every choice that fits at one step, with its longest length; longest first, then fastest."""
    step = 1024 * w.sequence_parallel
    cap = w.shape.max_positions or NO_POSITIONS_CAP
    cap -= cap % step

    def at(seq: int, c: pl.Choice) -> pl.Prediction:
        tiled = tiled_mlp_on(tiled_setting, seq, w.sequence_parallel)[0]
        return pl.predict(replace(w, seq_len=seq, tiled_mlp=tiled), c, hw)

    def longest(c: pl.Choice, ok: Any, good: int) -> int:
        """The longest length from `good` (which passes `ok`) on: doubled while it passes, then bisected."""
        bad = None
        while bad is None:
            nxt = min(good * 2, cap)
            if nxt == good:
                break
            if ok(at(nxt, c)):
                good = nxt
            else:
                bad = nxt
        while bad is not None and bad - good > step:
            mid = (good + bad) // 2 // step * step
            good, bad = (mid, bad) if ok(at(mid, c)) else (good, mid)
        return good

    def fills(p: pl.Prediction) -> bool:  # the peak alone (no allocator margin) within the card
        return p.fits_host and p.peak_allocated_gib + pl.CUDA_CONTEXT_GIB <= hw.gpu_mem_gib

    base = replace(w, seq_len=step)
    pl.plan(base, hw, **limits)  # the rules (sequence parallelism, LoRA targets) once, as `toolkit plan` says them
    out: list[Longest] = []
    for c in pl.choices(base, hw, **limits):
        if step > cap or not at(step, c).fits:
            continue
        good = longest(c, lambda p: p.fits, step)
        out.append(Longest(at(good, c), good, capped=good == cap, edge=longest(c, fills, good)))
    # among equal lengths the faster, then the smaller GPU need; memory-lean ZeRO sizes only where they reach further
    out.sort(key=lambda x: (-x.seq_len, -x.prediction.tokens_per_s_per_gpu, x.prediction.gpu_need_gib))
    return out


def render(rows: list[Longest], top: int, describe: Any) -> str:
    if not rows:
        return "nothing fits even at the shortest step"
    lines = [f"{'#':<3} {'longest':>9}  {'edge':>9}  {'GPU need':>8}  {'host/node':>9}  {'tokens/s/GPU':>12}  choice"]
    for i, r in enumerate(rows[:top], 1):
        p = r.prediction
        lines.append(f"{i:<3} {r.seq_len:>9,}  {r.edge:>9,}  {p.gpu_need_gib:>8.1f}  {p.host_node_gib:>9.1f}  "
                     f"{p.tokens_per_s_per_gpu:>12,.0f}  {describe(p)}"
                     + (" (the model's positions: --rope-factor to go further)" if r.capped else ""))
    lines.append(f"{len(rows)} choices fit at the shortest step; GiB per rank at each choice's longest length, "
                 f"predicted. longest: the GPU need (peak + {pl.ALLOC_MARGIN:.0%} for the allocator + CUDA context) "
                 "fits; edge: the peak alone fits (the limit with no margin; runs get within a step of it with "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    return "\n".join(lines)


def to_json(rows: list[Longest]) -> list[dict[str, Any]]:
    return [{"seq_len": r.seq_len, "edge_seq_len": r.edge, "capped_by_positions": r.capped,
             "choice": r.prediction.to_json()["choice"], "gpu_need_gib": r.prediction.gpu_need_gib,
             "host_node_gib": r.prediction.host_node_gib,
             "tokens_per_s_per_gpu": r.prediction.tokens_per_s_per_gpu,
             "activation_offload": r.prediction.activation_offload} for r in rows]
