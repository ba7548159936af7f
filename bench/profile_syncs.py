"""Where a profiled step makes the host wait for the GPU: every CUDA synchronize call of a torch.profiler trace
(train.profile_steps writes run_dir/profile/rank{N}.trace.json) with the CPU operators it ran inside, outermost first.

    python bench/profile_syncs.py RUN_DIR/profile/rank0.trace.json [--out syncs.json]

A synchronize drains the GPU's queue: the host then launches the next kernels while the GPU idles, so a step with many
of them is bound by the host even where its kernels are large. Printed: each distinct chain of enclosing operators,
how many synchronizes it made and how long the host waited in them.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from pathlib import Path
from typing import Any

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def chains(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Each synchronize's enclosing CPU operators (same thread, its interval inside theirs), outermost first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ops: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[(e.get("pid"), e.get("tid"))].append(e)
    for v in ops.values():
        v.sort(key=lambda e: e["ts"])
    starts = {k: [e["ts"] for e in v] for k, v in ops.items()}
    out = []
    for e in events:
        if e.get("cat") != "cuda_runtime" or e["name"] not in SYNCS:
            continue
        key = (e.get("pid"), e.get("tid"))
        i = bisect.bisect_right(starts.get(key, []), e["ts"])
        inside = [o for o in ops.get(key, [])[:i] if o["ts"] + o["dur"] >= e["ts"] + e["dur"]]
        out.append({"call": e["name"], "us": e["dur"], "chain": [o["name"] for o in inside]})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    found = chains(json.loads(Path(a.trace).read_text()))
    by: dict[tuple[str, ...], list[float]] = collections.defaultdict(list)
    for f in found:
        by[(f["call"], *f["chain"][:3], *f["chain"][-2:])].append(f["us"])
    rows = sorted(({"chain": list(k), "calls": len(v), "wait_ms": round(sum(v) / 1e3, 2)} for k, v in by.items()),
                  key=lambda r: -r["calls"])
    for r in rows:
        print(f"{r['calls']:5d}  {r['wait_ms']:9.2f} ms  {' > '.join(r['chain'])}")
    if a.out:
        Path(a.out).write_text(json.dumps({"trace": a.trace, "syncs": len(found), "chains": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
