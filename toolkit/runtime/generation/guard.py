"""`synced_gpus` where a sharded ZeRO-3 forward needs it, and the HF model inside an engine.

Under ZeRO-3 without a whole-model gather every forward gathers each layer's shards from all ranks, so a
rank that stops generating early (EOS) or has fewer prompts leaves the others blocked in a collective.
`synced_gpus=True` keeps a finished rank running dummy forwards until all are done.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from toolkit.launch import dist

UNGUARDED = "_toolkit_unguarded_generate"


def world() -> int:
    import torch.distributed as tdist

    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def unwrap(engine_or_model: Any) -> Any:
    """The HF model (or PeftModel) inside a DeepSpeed engine; the object itself otherwise."""
    if "deepspeed" in sys.modules:
        from deepspeed import DeepSpeedEngine

        if isinstance(engine_or_model, DeepSpeedEngine):
            return engine_or_model.module
    return engine_or_model


def is_zero3_partitioned(model: Any) -> bool:
    """True when ZeRO-3 manages this model's parameters (they carry DeepSpeed's ds_status)."""
    return any(hasattr(q, "ds_status") for q in model.parameters())


def guard_generate(model: Any, zero3: bool | None = None) -> Any:
    """Make `model.generate` safe under ZeRO-3: synced_gpus is forced on when >1 rank runs.

    transformers 5 already defaults synced_gpus to True under ZeRO-3, but only while an
    HfDeepSpeedConfig is alive, and an explicit `synced_gpus=False` (common in scripts written for
    one GPU) still hangs every rank. Here an explicit False is overridden with a warning: the run
    completes, the only cost is the dummy forwards. Idempotent; returns the model. The toolkit's own
    whole-model path calls the unguarded generate (`unguarded`): with every layer gathered it runs no
    collective, and ranks may then make different numbers of calls.
    """
    if getattr(model, UNGUARDED, None) is not None:
        return model
    original = model.generate
    warned: list[bool] = []

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        on = is_zero3_partitioned(model) if zero3 is None else zero3
        if on and world() > 1 and kwargs.get("synced_gpus") is not True:
            if kwargs.get("synced_gpus") is False and not warned and dist.rank() == 0:
                warned.append(True)
                print(
                    "warning: generate(synced_gpus=False) under ZeRO-3 with >1 rank would hang when ranks "
                    "finish at different steps; using synced_gpus=True",
                    file=sys.stderr,
                    flush=True,
                )
            kwargs["synced_gpus"] = True
        return original(*args, **kwargs)

    # Plain attributes on the instance (functions are not Modules, so nn.Module stores them as-is).
    setattr(model, UNGUARDED, original)
    model.generate = generate
    return model


def unguarded(model: Any) -> Any:
    """The model's generate without the guard (the guard's own when it is not installed)."""
    return getattr(model, UNGUARDED, model.generate)
