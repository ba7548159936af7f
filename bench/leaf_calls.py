"""A ZeRO-3 leaf layer's host time a call, from rows run several times by turns in one lease: each row's median
tokens/s a GPU over its runs, the step that makes, its leaf calls, the milliseconds a call and a module (where the step
waits on the host alone, that is the leaf calls' time), and the planner's tokens/s as it is now against the median.

    python bench/leaf_calls.py bench/results/speed_model/families/leaf_calls/round_*.json [--markdown]

Each round file holds plan_calibrate.py rows (one launch each); the rounds ran the same rows in other orders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plan_calibrate import Config, predict  # noqa: E402

from toolkit.plan import planner as pl  # noqa: E402
from toolkit.plan.shapes import load_shape  # noqa: E402


def by_row(paths: list[Path]) -> dict[str, tuple[dict[str, Any], list[float]]]:
    """name -> (config, tokens/s a GPU of each run that finished), in the order the files give them."""
    out: dict[str, tuple[dict[str, Any], list[float]]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if row["rc"] == 0:
                out.setdefault(row["config"]["name"], (row["config"], []))[1].append(
                    row["measured"]["tokens_per_s_per_gpu"])
    return out


def table(rows: dict[str, tuple[dict[str, Any], list[float]]]) -> list[dict[str, Any]]:
    out = []
    for name, (c, runs) in rows.items():
        config = Config(**{**c, "extra": tuple(c["extra"])})
        shape = load_shape(config.model)
        layers = config.layers or shape.num_layers
        calls = 2 * layers * (1 + config.ckpt)  # forward and backward a layer, and the recompute
        median = statistics.median(runs)
        step = config.seq * config.micro * config.accum / median
        planned = predict(config, 139.0, False).tokens_per_s_per_gpu
        out.append({"row": name, "runs": [round(r) for r in runs], "median": round(median), "step_s": round(step, 4),
                    "calls": calls, "modules": shape.layer_modules, "tensors": len(shape.layer_params),
                    "ms_a_call": round(1e3 * step / calls, 2),
                    "ms_a_module": round(1e3 * step / calls / shape.layer_modules, 3),
                    "planned": round(planned), "error": round(planned / median - 1, 4)})
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| row | runs (tokens/s a GPU) | median | step s | leaf calls | modules (tensors) | ms a call | ms a module "
            "| planned | error |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['row']} | {', '.join(f'{x:,}' for x in r['runs'])} | {r['median']:,} | {r['step_s']:.3f} | {r['calls']} "
        f"| {r['modules']} ({r['tensors']}) | {r['ms_a_call']:.2f} | {r['ms_a_module']:.3f} | {r['planned']:,} "
        f"| {100 * r['error']:+.1f}% |\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", nargs="+", type=Path)
    ap.add_argument("--markdown", action="store_true", help="a markdown table instead of JSON lines")
    a = ap.parse_args()
    rows = table(by_row(a.rounds))
    print(markdown(rows) if a.markdown else "\n".join(json.dumps(r) for r in rows))
    print(f"planner: {1e3 * pl.ZERO3_LEAF_S[2]:.2f} ms a call of {pl.ZERO3_LEAF_MODULES} modules on 2 GPUs",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
