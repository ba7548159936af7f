"""What is alive on the GPU at the moment of the peak: one toolkit run under torch's allocator history.

    deepspeed --num_gpus 2 bench/peak_anatomy.py OUT.json --ds ds_configs/zero3.json model.name=llama-1b ...

Rank 0 records every allocation (torch.cuda.memory._record_memory_history, Python stacks), replays the
trace after the run, finds the moment allocated bytes peak, and writes the live tensors at that moment
grouped by the innermost DeepSpeed / transformers / peft / toolkit frame that allocated them. Peak
allocated alone cannot say why ZeRO-3 peaks above ZeRO-2; this can. Slow (stack capture on every
allocation): use a few steps.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])

OURS = ("deepspeed/", "transformers/", "peft/", "toolkit/", "accelerate/")
PHASES = {"backward": "backward", "step": "step", "forward": "forward", "_take_model_step": "step",
          "initialize": "init", "from_pretrained": "init", "build_model": "init"}


def _site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(innermost library frame, coarse phase) of one allocation's Python stack (innermost first)."""
    site = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                 for f in frames if any(o in f["filename"] for o in OURS)), "?")
    phase = next((PHASES[f["name"]] for f in frames if f["name"] in PHASES), "other")
    return site, phase


def _signed(events: list[dict[str, Any]]) -> list[int]:
    return [e.get("size", 0) * (1 if e["action"] == "alloc" else -1) for e in events
            if e["action"] in ("alloc", "free_requested")]


def analyze(snapshot: dict[str, Any], device: int = 0, top: int = 25, at_size: int = 0,
            first: bool = False) -> dict[str, Any]:
    """The live tensors at the peak of allocated bytes, or (at_size) just after the last (first) allocation within
    0.1% of that size."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, event index)
    total = peak = peak_at = 0
    peak_live: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            total += e["size"]
            if (total > peak and not at_size) or (at_size and abs(e["size"] - at_size) <= at_size // 1000
                                                  and not (first and peak_live)):
                peak, peak_at = total, i
                peak_live = dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:  # when torch's allocated stat drops
            total -= live.pop(e["addr"])[0]
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for size, i in peak_live.values():
        g = groups[_site(events[i].get("frames", []))]
        g[0] += size
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    sizes: dict[int, int] = defaultdict(int)  # tensor size -> count, at the peak (1 MiB and up)
    for size, _ in peak_live.values():
        if size >= 1 << 20:
            sizes[size] += 1
    return {
        "events": len(events),  # equal to max_entries means the ring buffer dropped the start: invalid
        "peak_gib": peak / 2**30,
        "peak_event": peak_at,
        "peak_event_site": _site(events[peak_at].get("frames", [])) if events else None,
        "live_at_peak": [{"site": s, "phase": p, "gib": round(b / 2**30, 4), "tensors": n}
                         for (s, p), (b, n) in rows[:top]],
        "rest_gib": round(sum(b for _, (b, _) in rows[top:]) / 2**30, 4),
        "sizes_at_peak": {str(k): v for k, v in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])},
        # the allocations (+bytes) and frees (-bytes) up to the peak's own and the 10 after: without stacks,
        # their sizes say the phase
        "to_peak": _signed(events[max(0, peak_at - 40):peak_at + 1]),
        "after_peak": _signed(events[peak_at + 1:peak_at + 11]),
        "small_at_peak_gib": round(sum(b for b, _ in peak_live.values() if b < 1 << 20) / 2**30, 4),
    }


def main() -> int:
    import torch

    from toolkit import train
    from toolkit.launch import dist

    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
    out, args = Path(argv[0]), argv[1:]
    if torch.cuda.is_available() and dist.rank() == 0:
        # PEAK_ANATOMY_STACKS=0: no stacks (torch 2.13's Python tracer broke DeepSpeed's TiledMLP.apply inside a
        # checkpoint's recompute: "SystemError: apply returned NULL"); the live tensors' sizes still say a lot
        stacks = os.environ.get("PEAK_ANATOMY_STACKS", "1") != "0"
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python",
                                                 context="all" if stacks else None)
    rc = train.main(args)
    if torch.cuda.is_available() and dist.rank() == 0:
        # (torch.cuda.max_memory_allocated is no use here: the toolkit resets it at every snapshot)
        at_size = int(os.environ.get("PEAK_ANATOMY_AT_SIZE", "0"))  # the live set at another moment than the peak
        first = os.environ.get("PEAK_ANATOMY_AT_FIRST", "0") == "1"
        result = analyze(torch.cuda.memory._snapshot(), top=60, at_size=at_size, first=first) | {"args": args, "rc": rc}
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
