"""Keys: stage-3-only settings below stage 3, and deprecated ones (both from DeepSpeed's pydantic
ZeRO model). Unknown keys come from tracing DeepSpeed's own parse: `deepspeed_parse._unread_findings`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from toolkit.config import ds_config as dc
from toolkit.config.checks.base import Ctx, Finding, _warn

# Not marked in the pydantic model, but engine.py passes sub_group_size only to the stage-3 optimizer.
_STAGE3_EXTRA = {"sub_group_size"}


def rule_stage3_keys(c: Ctx) -> list[Finding]:
    if c.stage == 3:
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stage3 = set(_STAGE3_EXTRA)
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        if f.alias and f.alias.startswith("stage3_"):
            stage3 |= {name, f.alias}
        elif name.startswith("stage3_"):
            stage3.add(name)
    return [
        _warn(f"zero_optimization.{k}", f"stage-3-only setting, ignored at stage {c.stage}")
        for k in c.zero
        if k in stage3
    ]


def _walk_models(model: Any, prefix: str) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, field info, owning model) for a pydantic model and its nested models."""
    import typing

    for name, f in model.model_fields.items():
        yield f"{prefix}.{f.alias or name}", f, model
        for t in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(t, type) and hasattr(t, "model_fields"):
                yield from _walk_models(t, f"{prefix}.{f.alias or name}")


def rule_deprecated(c: Ctx) -> list[Finding]:
    # DeepSpeed marks them with json_schema_extra={"deprecated": True, "new_param": ...}
    # (deepspeed/runtime/config_utils.py) and only logs a warning; only the ZeRO model has training ones.
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = []
    for key, f, _ in _walk_models(DeepSpeedZeroConfig, "zero_optimization"):
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if not extra.get("deprecated"):
            continue
        present, value = dc._get(c.raw, key)
        if present:
            new = extra.get("new_param")
            out.append(
                _warn(
                    key,
                    "deprecated"
                    + (f"; use zero_optimization.{new} instead" if new else "")
                    + (
                        ' (e.g. {"device": "cpu"})'
                        if new in ("offload_optimizer", "offload_param") and value
                        else ""
                    ),
                )
            )
    return out
