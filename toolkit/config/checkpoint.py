"""A model directory's safetensors checkpoint: the tensor names it holds, and whether they are the model's own.

What lets a 4-bit base be read module by module (toolkit/runtime/quant build_4bit), and what `toolkit plan` counts
as a bounded build for a directory. Here, below both, so that the planner can ask without importing the runtime.
"""

from __future__ import annotations

from typing import Any


def checkpoint_files(path: str, model_keys: list[str]) -> dict[str, str] | None:
    """Each tensor name of a directory's safetensors checkpoint -> its file, where the names are the model's own
    (`model_keys`: its parameters, tied ones once, and persistent buffers): what build_4bit can read module by
    module. None where they are not (no safetensors, or names transformers would convert while loading: a legacy
    layout, fused experts); such a directory is loaded whole, then quantized."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(path)
    index, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index.is_file():
        found = {k: str(root / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif single.is_file():
        with safe_open(str(single), "pt") as f:
            found = dict.fromkeys(f.keys(), str(single))
    else:
        return None
    return found if set(model_keys) <= set(found) else None


def model_keys(auto: Any, mc: Any, kwargs: dict[str, Any]) -> list[str]:
    """The tensor names a checkpoint of this model holds: its parameters (tied ones once) and persistent buffers,
    read from a copy on the meta device."""
    import torch
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():
        model = auto.from_config(mc, **kwargs)
    model.tie_weights()
    keys = [n for n, _ in model.named_parameters()]
    return keys + [n for n, _ in model.named_buffers() if n in model.state_dict()]
