"""ZeRO-3 leaf modules chosen by `stage3_module_granularity_threshold`: a warning before launch.

The JSON alone cannot say which modules DeepSpeed will pick (that needs the model), so this is a
warning; the training run checks the modules DeepSpeed marked and refuses the case that trains on no
gradient (`toolkit.runtime.model.check_zero3_leaves`).
"""

from __future__ import annotations

from toolkit.config.checks.base import Ctx, Finding, _num, _warn

KEY = "stage3_module_granularity_threshold"


def rule_leaf_threshold(c: Ctx) -> list[Finding]:
    threshold = _num(c.zero.get(KEY))
    if c.stage != 3 or not threshold:
        return []
    return [_warn(
        f"zero_optimization.{KEY}",
        f"{threshold:g} makes DeepSpeed choose leaf modules parent-first by parameters per layer: above a "
        "decoder layer's granularity the whole model or its backbone becomes the leaf, and a leaf that takes "
        "token ids never gets its gradients reduced (gradient norm 0.0, no error; toolkit/train.py refuses "
        "that case at start). At the decoder layer's granularity it changed llama-1b's gradients on 2x H200 "
        "(first-step norm 2.33 vs 2.155; bench/results/zero3_tuning.md). Prefer 0 (the default)",
    )]
