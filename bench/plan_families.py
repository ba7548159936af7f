"""Which causal LM families of the installed transformers `toolkit plan` models, and why the others are refused.

    python bench/plan_families.py --out bench/results/speed_model/families/sweep.json

Every model type transformers maps to a causal LM, at its config's defaults with at most 8 decoder layers (the layers are
traced on fake tensors, so the widths cost nothing), planned at ZeRO-2 on one 80 GiB GPU, 8 x 1,024 tokens. Written:
the types that plan, each refused one with its one-line reason, the types whose own defaults fail validation.
tests/unit/test_trace.py runs the same sweep (toolkit/plan/families.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sweep() -> dict:
    from transformers import __version__

    from toolkit.plan.families import causal_lm_types
    from toolkit.plan.families import sweep as sweep_types

    return {"transformers": __version__, "types": len(causal_lm_types())} | sweep_types()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    r = sweep()
    Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    kinds = ("encoder-decoder", "multimodal", "per layer", "could not be traced on fake tensors",
             "could not build", "has none of", "cannot find", "needs a causal language model")
    reasons = collections.Counter(next((k for k in kinds if k in m), m) for m in r["refused"].values())
    print(f"{r['types']} causal LM types (transformers {r['transformers']}): {len(r['planned'])} plan, "
          f"{len(r['refused'])} refused, {len(r['defaults_invalid'])} with invalid defaults")
    for why, n in reasons.most_common():
        print(f"  {n:3d}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
