"""QLoRA's frozen 4-bit base (model.load_in_4bit): every Linear of the model but its head becomes bitsandbytes'
Linear4bit (NF4 or FP4, double quantization, compute in the run's float dtype), the way transformers' bitsandbytes
integration and PEFT's QLoRA recipe build it, before the LoRA adapters are added.

Written here rather than through `from_pretrained(quantization_config=BitsAndBytesConfig(...))`: transformers
quantizes only while loading weights from files, and the toolkit also builds presets at random init from a config;
one path for both keeps the two alike. What the recipe's rules need is kept:
- the packed weights are stored in the run's float dtype (`bnb_4bit_quant_storage`): DeepSpeed casts the module to
  bf16 (or keeps fp32 on CPU) and ZeRO-3 flattens, partitions and gathers parameters of that dtype, so storage in
  that dtype is what lets ZeRO-3 shard the base like bf16 weights (../shared/notes/qlora.md section 1);
- the head stays in the float dtype (transformers skips the output embeddings too);
- each layer is quantized where it will run (the rank's GPU, or the CPU), one Linear at a time.
Measured on 2 CPU ranks (bitsandbytes 0.50.2, fp32 storage): ZeRO-0, 2 and 3 give the same losses
(tests/dist/test_train.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from toolkit.config.ds_config import ConfigError


def available() -> str | None:
    """None, or why bitsandbytes cannot be used here (one line)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # ImportError, or a broken native library
        return (f"model.load_in_4bit needs bitsandbytes ({type(e).__name__}: {e}); pip install bitsandbytes, or "
                "set model.load_in_4bit=false")
    return None


def storage_dtype(precision: str) -> Any:
    """The dtype the packed weights are stored and computed in: the one DeepSpeed gives the module (bf16 in its bf16
    mode, else fp32); any other would be cast into other numbers."""
    import torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def quantize_4bit(model: Any, *, dtype: Any, quant_type: str, device: Any) -> int:
    """Swap every nn.Linear but the head for a 4-bit Linear4bit holding the same weights; returns how many."""
    import bitsandbytes as bnb
    import torch

    why = available()
    if why:
        raise ConfigError(why)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(head)} | {id(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("score", "classifier")}
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or id(child) in skip:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=dtype, compress_statistics=True, quant_type=quant_type,
                                  quant_storage=dtype, device="meta")
            # Params4bit quantizes when it moves to a device: here, where the layer will run
            q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.float32), requires_grad=False,
                                         compress_statistics=True, quant_type=quant_type, quant_storage=dtype)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.to(dtype), requires_grad=False)
            q = q.to(device)
            # On a CPU with AVX512-BF16, bitsandbytes repacks a layer's weights into a bf16 inference layout at its
            # first forward in eval mode without gradients (an eval loss, resume's fixed-batch check) and keeps them
            # so: every later training step would then compute in other numbers than before it. Kept off; GPUs
            # never take that path.
            q.support_avx512bf16_for_cpu = False
            setattr(parent, name, q)
            del child
            done += 1
    if not done:
        raise ConfigError("model.load_in_4bit: the model has no nn.Linear layers to quantize")
    return done


@contextlib.contextmanager
def without_zero_init(on: bool) -> Iterator[None]:
    """Build outside DeepSpeed's zero.Init (transformers does the same for quantized models: zero.Init cannot hold
    4-bit weights, bitsandbytes#1249): the float weights exist whole on each rank until they are quantized."""
    if not on:
        yield
        return
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref  # read only to put it back
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if ref is not None and ref() is not None:
            hf_ds.set_hf_deepspeed_config(ref())

