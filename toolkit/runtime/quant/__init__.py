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


def _skipped(model: Any) -> set[int]:
    """ids of the Linears that stay in the float dtype: the head (and a classifier's score), as transformers skips."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {id(head)} | {id(m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("score", "classifier")}


def _linear_4bit(child: Any, *, dtype: Any, quant_type: str, device: Any) -> Any:
    """A Linear4bit holding `child`'s weights, quantized where the layer will run."""
    import bitsandbytes as bnb
    import torch

    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                          compute_dtype=dtype, compress_statistics=True, quant_type=quant_type,
                          quant_storage=dtype, device="meta")
    # Params4bit quantizes when it moves to a device: here, where the layer will run
    q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.float32), requires_grad=False,
                                 compress_statistics=True, quant_type=quant_type, quant_storage=dtype)
    if child.bias is not None:
        q.bias = torch.nn.Parameter(child.bias.data.to(dtype), requires_grad=False)
    q = q.to(device)
    # On a CPU with AVX512-BF16, bitsandbytes repacks a layer's weights into a bf16 inference layout at its first
    # forward in eval mode without gradients (an eval loss, resume's fixed-batch check) and keeps them so: every later
    # training step would then compute in other numbers than before it. Kept off; GPUs never take that path.
    q.support_avx512bf16_for_cpu = False
    return q


def quantize_4bit(model: Any, *, dtype: Any, quant_type: str, device: Any) -> int:
    """Swap every nn.Linear but the head for a 4-bit Linear4bit holding the same weights; returns how many."""
    import torch

    why = available()
    if why:
        raise ConfigError(why)
    skip = _skipped(model)
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or id(child) in skip:
                continue
            setattr(parent, name, _linear_4bit(child, dtype=dtype, quant_type=quant_type, device=device))
            del child
            done += 1
    if not done:
        raise ConfigError("model.load_in_4bit: the model has no nn.Linear layers to quantize")
    return done


def build_4bit(auto: Any, mc: Any, seed: int, kwargs: dict[str, Any], *, dtype: Any, quant_type: str,
               device: Any, weights: dict[str, str] | None = None) -> tuple[Any, int]:
    """A preset at random init, quantized while it is built: (model, Linears quantized). The host never holds the
    float model: it is built on the meta device, then transformers' init walk (initialize_weights: children first,
    one seeded stream) runs module by module, giving each its memory just before its init, and each Linear becomes
    4-bit right after its own. The host holds the float weights that stay (embeddings, head, norms) and one Linear:
    about 9 GiB a rank for Llama-3-70B, where building it whole in fp32 first took 264 GiB. The same stream in the same
    order: on the CPU the weights are those of the whole-model build (tests/unit/test_qlora.py); on a GPU the
    quantized Linears draw from the GPU's generator (seeded alike), so they differ from a host build's.

    weights (a directory's, toolkit/config/checkpoint.py): each module's tensors are read from the checkpoint right
    after its init, before a Linear is quantized, so a directory loads as boundedly as a preset builds. The init still
    runs first: it computes what the checkpoint does not hold (rotary tables), as transformers' loader does."""
    import torch
    from safetensors import safe_open
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions, no_init_weights

    why = available()
    if why:
        raise ConfigError(why)
    with torch.device("meta"), no_init_weights():
        model = auto.from_config(mc, **kwargs)
    skip = _skipped(model)
    names: dict[int, str] = {}  # a module's first name: the one its tensors go by in a checkpoint (model_keys)
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), n)
    files: dict[str, Any] = {}
    made: dict[int, Any] = {}  # meta parameter id -> its real tensor: tied weights stay one tensor
    keep: list[Any] = []  # the meta originals, so that their ids are not reused while `made` holds them
    done = 0

    def materialize(module: Any) -> None:
        # a Linear to be quantized gets its float weights where it will run: its init and quantization then run on
        # the GPU (initializing Llama-3-70B's Linears on the host took more than 8 minutes, one thread a rank)
        where = device if type(module) is torch.nn.Linear and id(module) not in skip else "cpu"
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                keep.append(p)
                made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=where), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="cpu")

    def walk(module: Any, fn: Any, custom: bool) -> None:  # transformers' smart_apply, materializing as it goes
        nonlocal done
        for name, child in list(module.named_children()):
            walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn, custom)
            if type(child) is torch.nn.Linear and id(child) not in skip:
                setattr(module, name, _linear_4bit(child, dtype=dtype, quant_type=quant_type, device=device))
                for k in [k for k, v in made.items() if v is child.weight or v is child.bias]:
                    del made[k]  # nothing holds the float weights now
                done += 1
        materialize(module)
        fn(module, custom)
        if weights is not None:
            load(module)

    def load(module: Any) -> None:  # the module's own tensors from the checkpoint, cast as from_pretrained casts them
        prefix = f"{names[id(module)]}." if names[id(module)] else ""
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                key = prefix + name
                if t is None or key not in weights:
                    continue
                if weights[key] not in files:
                    files[weights[key]] = safe_open(weights[key], "pt", device="cpu")
                t.data.copy_(files[weights[key]].get_tensor(key))

    torch.manual_seed(seed)
    with torch.no_grad(), guard_torch_init_functions():
        walk(model, model._initialize_weights, model.is_custom_code())
    files.clear()
    model.tie_weights()
    if not done:
        raise ConfigError("model.load_in_4bit: the model has no nn.Linear layers to quantize")
    return model, done


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

