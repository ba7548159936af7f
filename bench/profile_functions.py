"""Where a profiled step's host time goes, by Python function: calls and inclusive milliseconds of each function whose
name matches a pattern, from a torch.profiler trace recorded with Python stacks (TOOLKIT_PROFILE_STACK=1 and
train.profile_steps; the trace is run_dir/profile/rank{N}.trace.json).

    python bench/profile_functions.py RUN_DIR/profile/rank0.trace.json [--match deepspeed --match DecoderLayer]

A function nested in itself (recursion, a module's `_call_impl` inside another's) counts once, at its outermost call,
so a row's milliseconds are wall time on the host threads that ran it. Python stacks slow the host: read the rows as
shares of the profiled steps, not as the unprofiled run's times.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any


def functions(trace: dict[str, Any], patterns: list[str]) -> list[dict[str, Any]]:
    """[{name, calls, ms, per_call_ms}] for every python_function event whose name holds one of `patterns` (all where
    none is given), by inclusive time, largest first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "python_function"
              and (not patterns or any(p in e.get("name", "") for p in patterns))]
    calls: collections.Counter[str] = collections.Counter()
    ms: collections.Counter[str] = collections.Counter()
    # outermost occurrences per (thread, name): an event inside an open one of the same name is not counted again
    open_until: dict[tuple[Any, Any, str], float] = {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        key = (e.get("pid"), e.get("tid"), e["name"])
        calls[e["name"]] += 1
        if e["ts"] >= open_until.get(key, float("-inf")):
            ms[e["name"]] += e["dur"] / 1e3
            open_until[key] = e["ts"] + e["dur"]
    return [{"name": n, "calls": calls[n], "ms": round(ms[n], 2), "per_call_ms": round(ms[n] / calls[n], 4)}
            for n in sorted(ms, key=lambda n: -ms[n])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--match", action="append", default=[], help="a substring of the function names to keep")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, help="write every row as JSON here")
    args = ap.parse_args(argv)
    rows = functions(json.loads(args.trace.read_text()), args.match)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    for r in rows[:args.top]:
        print(f"{r['ms']:10.1f} ms {r['calls']:7d} calls {r['per_call_ms']:8.3f} ms/call  {r['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
