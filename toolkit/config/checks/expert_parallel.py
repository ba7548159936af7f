"""`expert_parallel` (DeepSpeed's AutoEP, 0.19.2+): DeepSpeed's own validation of the block, the launch's rules,
and one that DeepSpeed cannot know: whether its AutoEP runs with the installed transformers as it stands.

deepspeed 0.19.8's AutoEP re-points transformers' output recorders (router logits for the load-balancing loss)
with `registry.get(key, default)` (module_inject/auto_ep_presets/base.py), and transformers 5.24's
`_CanRecordRegistry.get` takes no default: an AutoEP run fails inside deepspeed.initialize with a TypeError
(found here, on 2 CPU ranks). The toolkit's runs fix that first (toolkit/runtime/moe/autoep.py); the check warns
a script of one's own that it must do the same.
"""

from __future__ import annotations

from typing import Any

from toolkit.config.checks.base import Ctx, Finding, _err, _warn

KEY = "expert_parallel"


def enabled(ds: dict[str, Any]) -> bool:
    """The config turns AutoEP on (an `expert_parallel` block with enabled true)."""
    block = ds.get(KEY)
    return isinstance(block, dict) and bool(block.get("enabled", False))


def rule_expert_parallel(c: Ctx) -> list[Finding]:
    if not enabled(c.raw):
        return []
    block = c.raw[KEY]
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
    if c.consumer not in ("raw", "trainer") and registry_takes_no_default():  # toolkit/train.py fixes it itself
        from importlib.metadata import version

        out.append(_warn(f"{KEY}.enabled", (
            f"deepspeed {version('deepspeed')}'s AutoEP calls transformers' output-recorder registry with a string key "
            f"and a default that transformers {version('transformers')} does not take (_CanRecordRegistry.get): "
            "toolkit/train.py fixes it before deepspeed.initialize; a script of your own must call "
            "toolkit.runtime.moe.autoep.allow_string_keys() first, or deepspeed.initialize fails with a TypeError")))
    return out


def registry_takes_no_default() -> bool:
    """transformers' output-recorder registry is the model-keyed `_CanRecordRegistry` whose get takes no default
    (5.2x), not the plain dict deepspeed 0.19.8's AutoEP reads and writes (transformers 5.17 and before), and
    this process has not fixed it."""
    try:
        from transformers.utils.output_capturing import _CanRecordRegistry
    except ImportError:
        return False  # the plain dict: nothing to fix
    if getattr(_CanRecordRegistry, "_toolkit_string_keys", False):
        return False  # fixed in this process already (toolkit/runtime/moe/autoep.py)
    # by behaviour, as DeepSpeed uses it: a string key written, then read with a default
    probe = _CanRecordRegistry()
    try:
        probe["<class 'probe'>"] = {}
        return probe.get("<class 'probe'>", None) is None or "<class 'probe'>" not in dict.keys(probe)
    except TypeError:
        return True
