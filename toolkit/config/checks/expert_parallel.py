"""`expert_parallel` (DeepSpeed's AutoEP, 0.19.2+): DeepSpeed's own validation of the block, the launch's rules,
and one that DeepSpeed cannot know: whether its AutoEP can run with the installed transformers.

deepspeed 0.19.8's AutoEP re-points transformers' output recorders (router logits for the load-balancing loss)
with `registry.get(key, default)` (module_inject/auto_ep_presets/base.py), and transformers 5.24's
`_CanRecordRegistry.get` takes no default: every AutoEP run then fails inside deepspeed.initialize with a
TypeError (found here, on 2 CPU ranks). The check says so before launch instead.
"""

from __future__ import annotations

import inspect

from toolkit.config.checks.base import Ctx, Finding, _err, _warn

KEY = "expert_parallel"


def rule_expert_parallel(c: Ctx) -> list[Finding]:
    block = c.raw.get(KEY)
    if not isinstance(block, dict) or not block.get("enabled", False):
        return []
    out: list[Finding] = []
    try:
        from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config
    except ImportError:
        return [_err(KEY, "this deepspeed has no AutoEP (it came in 0.19.2, ZeRO-3 support in 0.19.3)")]
    try:
        validate_autoep_config(parse_autoep_config(block), c.world_size, 1, 1, 1, zero_stage=c.stage,
                               zero_offload_optimizer=c.offload("offload_optimizer")[0] != "none",
                               zero_offload_param=c.offload("offload_param")[0] != "none")
    except (ValueError, TypeError) as e:
        out.append(_err(KEY, f"DeepSpeed refuses it: {e}"))
    size = block.get("autoep_size", 1)
    if size == 1:
        out.append(_warn(f"{KEY}.autoep_size", "1: every rank keeps every expert (no all-to-all); AutoEP then only "
                                               "swaps the experts' kernels"))
    why = autoep_blocked()
    if why:
        out.append(_err(f"{KEY}.enabled", why))
    return out


def autoep_blocked() -> str | None:
    """Why the installed deepspeed's AutoEP cannot run with the installed transformers, or None."""
    try:
        from transformers.utils.output_capturing import _CanRecordRegistry
    except ImportError:
        return None  # no such registry: nothing for AutoEP to re-point
    params = list(inspect.signature(_CanRecordRegistry.get).parameters)
    if len(params) >= 3:  # (self, key, default)
        return None
    from importlib.metadata import version

    return (f"deepspeed {version('deepspeed')}'s AutoEP calls transformers' output-recorder registry with a default "
            f"that transformers {version('transformers')} does not take (_CanRecordRegistry.get): "
            "deepspeed.initialize would fail with a TypeError. Leave expert_parallel off with these versions")
