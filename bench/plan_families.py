"""Which causal LM families of the installed transformers `toolkit plan` models, and why the others are refused.

    python bench/plan_families.py --out bench/results/speed_model/families/sweep.json

Every model type transformers maps to a causal LM, at its config's defaults with at most 8 decoder layers (the layers are
traced on fake tensors, so the widths cost nothing), planned at ZeRO-2 on one 80 GiB GPU, 8 x 1,024 tokens. Written:
the types that plan, each refused one with its one-line reason, the types whose own defaults fail validation.
tests/unit/test_trace.py runs the same sweep.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sweep() -> dict:
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from toolkit.config.ds_config import ConfigError
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import family_defaults, read_shape

    planned: dict[str, float] = {}
    refused: dict[str, str] = {}
    invalid: list[str] = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = family_defaults(model_type)
        except Exception:
            invalid.append(model_type)
            continue
        try:
            s = read_shape(cfg)
            p = pl.predict(pl.Workload(s, 1024, 8), pl.Choice(2, "none", 1.0, 1, 8, False, "speed"),
                           pl.Hardware(1, 1, 80.0))
            planned[model_type] = round(p.peak_allocated_gib, 2)
        except ConfigError as e:
            refused[model_type] = str(e)
    return {"transformers": __version__, "types": len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), "planned": planned,
            "refused": refused, "defaults_invalid": invalid}


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
