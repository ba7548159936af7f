"""Causal attention's speed for the planner: measured kernel rates by head dim and length, not a constant of one shape.

The rates are in the planner's own FLOP count (12 x heads x head_dim x length a token for forward + backward, 4 x for
forward alone: causal work counted as full, as toolkit/observe/metrics.py counts it), measured with sdpa as
transformers calls it on unpacked rows (enable_gqa, is_causal), bf16, one layer's attention, 32,768 tokens a call
(`python bench/attention.py --rates`, one H200: bench/results/speed_model/attention_rates_h200.json). Query / kv head
counts move the rate by a few percent at one head dim (GQA 4:1 to 8:1 and 1:1 measured), the head dim by 1.3x (64
against 128), the length by 2x (1K against 32K), so the table keeps head dim and length: the median over the
measured head counts at each. Written by `python -m toolkit.plan.attention_rates RATES.json`.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import Any

RATES_FILE = Path(__file__).with_name("attention_rates.json")


@cache
def _table() -> dict[int, list[tuple[int, float, float]]]:
    """head_dim -> [(length, forward rate, forward + backward rate)], lengths ascending, FLOP/s."""
    data = json.loads(RATES_FILE.read_text())
    return {int(d): [(int(r[0]), float(r[1]) * 1e12, float(r[2]) * 1e12) for r in rows]
            for d, rows in data["rates"].items()}


def _at(rows: list[tuple[int, float, float]], length: float, backward: bool) -> float:
    """The rate at this length: linear in log2(length) between measured lengths, flat outside them."""
    i = 2 if backward else 1
    lengths = [r[0] for r in rows]
    if length <= lengths[0]:
        return rows[0][i]
    if length >= lengths[-1]:
        return rows[-1][i]
    j = bisect.bisect_right(lengths, length)
    (l0, *a), (l1, *b) = rows[j - 1], rows[j]
    f = (math.log2(length) - math.log2(l0)) / (math.log2(l1) - math.log2(l0))
    return a[i - 1] + (b[i - 1] - a[i - 1]) * f


def rate(head_dim: int, length: float, *, backward: bool = True) -> float:
    """FLOP/s (the planner's count) of causal attention over rows of `length` tokens: forward + backward, or forward
    alone. Head dims between the measured ones: linear between them; outside: the nearest."""
    table = _table()
    dims = sorted(table)
    if head_dim <= dims[0]:
        return _at(table[dims[0]], length, backward)
    if head_dim >= dims[-1]:
        return _at(table[dims[-1]], length, backward)
    j = bisect.bisect_right(dims, head_dim)
    d0, d1 = dims[j - 1], dims[j]
    r0, r1 = _at(table[d0], length, backward), _at(table[d1], length, backward)
    return r0 + (r1 - r0) * (head_dim - d0) / (d1 - d0)


def write(measured: dict[str, Any]) -> dict[str, Any]:
    """attention_rates.json from bench/attention.py --rates output: per head dim and length, the median over head
    counts of the forward and forward + backward rates (TFLOP/s)."""
    by: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in measured["rows"]:
        by.setdefault((r["head_dim"], r["seq"]), []).append(r)
    rates: dict[str, list[list[float]]] = {}
    for (dim, seq), rows in sorted(by.items()):
        rates.setdefault(str(dim), []).append([seq, round(statistics.median(r["fwd_tflops"] for r in rows), 1),
                                               round(statistics.median(r["fwd_bwd_tflops"] for r in rows), 1)])
    return {"gpu": measured["gpu"], "torch": measured["torch"], "source": "bench/results/speed_model/",
            "columns": ["length", "forward TFLOP/s", "forward + backward TFLOP/s"], "rates": rates}


if __name__ == "__main__":
    RATES_FILE.write_text(json.dumps(write(json.loads(Path(sys.argv[1]).read_text())), indent=1) + "\n")
    print(f"wrote {RATES_FILE}")
