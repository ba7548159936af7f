"""DeepSpeed's AutoEP (`expert_parallel`) with the installed transformers: the run's line about it, and the one
fix the two libraries need between them.

deepspeed 0.19.8's AutoEP re-points transformers' output recorders (the router logits the load-balancing loss
reads) through `output_capturing._CAN_RECORD_REGISTRY` as the plain dict it was: keyed by `str(cls)`, read with
`registry.get(key, default)`, restored with `registry[key] = entry`. transformers 5.2x made it `_CanRecordRegistry`,
whose `get(model)` and `__setitem__(model, entry)` take a model and key it by its class, so DeepSpeed's default
argument is a TypeError inside deepspeed.initialize and its restore would file the entry under "<class 'str'>".
No release of either fixes it (deepspeed 0.19.8, transformers 5.24). `allow_string_keys` lets a string key through
as the plain dict DeepSpeed expects and leaves every model-keyed call as transformers wrote it; with this fix
AutoEP trains with the same losses and gradient norms as the same run without it (tests/dist/test_moe.py).
"""

from __future__ import annotations

from typing import Any

from toolkit.config.checks.expert_parallel import enabled, registry_takes_no_default

__all__ = ["allow_string_keys", "enabled", "nothing_replaced", "prepare", "replaced"]


def allow_string_keys() -> bool:
    """Let DeepSpeed's string keys (and its default) through transformers' output-recorder registry; True if this
    transformers needed it. Idempotent; call before deepspeed.initialize (the toolkit's runs do)."""
    try:
        from transformers.utils.output_capturing import _CanRecordRegistry as Registry
    except ImportError:
        return False  # the plain dict DeepSpeed expects
    if getattr(Registry, "_toolkit_string_keys", False):
        return True
    if not registry_takes_no_default():
        return False
    by_model_get, by_model_set = Registry.get, Registry.__setitem__

    def get(self: Any, key: Any, *default: Any) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, *default)
        return by_model_get(self, key, *default)

    def setitem(self: Any, key: Any, value: Any) -> None:
        if isinstance(key, str):
            dict.__setitem__(self, key, value)
        else:
            by_model_set(self, key, value)

    Registry.get, Registry.__setitem__ = get, setitem  # type: ignore[method-assign]
    Registry._toolkit_string_keys = True  # type: ignore[attr-defined]
    return True


def prepare(ds: dict[str, Any], experts_per_layer: int) -> str:
    """Before deepspeed.initialize on every rank: the registry fix where needed; returns the run's line."""
    block = ds["expert_parallel"]
    size = int(block.get("autoep_size", 1))
    line = (f"expert parallelism: DeepSpeed's AutoEP, each layer's {experts_per_layer} experts split over groups of "
            f"{size} ranks ({experts_per_layer // max(size, 1)} per rank)" if experts_per_layer else
            f"expert parallelism: DeepSpeed's AutoEP over groups of {size} ranks (the toolkit finds no experts here)")
    if block.get("preset_model"):
        line += f", preset {block['preset_model']}"
    if allow_string_keys():
        from importlib.metadata import version

        line += (f"; transformers {version('transformers')}'s output-recorder registry takes DeepSpeed's string keys "
                 "(toolkit/runtime/moe/autoep.py)")
    return line


def replaced(model: Any) -> int:
    """MoE layers DeepSpeed's AutoEP replaced in the built engine's module."""
    return sum(type(m).__name__ == "AutoEPMoELayer" for m in model.modules())


def nothing_replaced(ds: dict[str, Any], model: Any) -> str:
    preset = ds["expert_parallel"].get("preset_model")
    return (f"expert_parallel is on, but DeepSpeed's AutoEP replaced no MoE layer of {type(model).__name__}"
            + (f" (preset_model={preset})" if preset else " (no preset_model: it guessed from the model)")
            + ": set expert_parallel.preset_model to the model's family (toolkit gen-config --ep-preset) or turn "
              "expert_parallel off")
