"""Every model type the installed transformers maps to a causal LM, planned at its config's defaults or refused in one
line (issue 60): at most 8 decoder layers (traced on fake tensors, so the widths cost nothing), ZeRO-2 on one 80 GiB
GPU, 8 x 1,024 tokens. bench/plan_families.py writes the whole sweep to sweep.json; tests/unit/test_trace.py runs it
and holds what it plans."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(types: Iterable[str] | None = None) -> dict[str, Any]:
    """{"planned": type -> planned peak GiB, "refused": type -> the one-line reason, "defaults_invalid": the types whose
    own defaults fail their validation (nothing a user could plan)} over `types` (default: every causal LM type)."""
    from toolkit.config.ds_config import ConfigError
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import family_defaults, read_shape

    planned: dict[str, float] = {}
    refused: dict[str, str] = {}
    invalid: list[str] = []
    for model_type in causal_lm_types() if types is None else types:
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
    return {"planned": planned, "refused": refused, "defaults_invalid": invalid}
