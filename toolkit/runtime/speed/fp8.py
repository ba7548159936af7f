"""`train.precision=fp8`: torchao float8 matmuls in the decoder layers' Linear modules, bf16 elsewhere.

DeepSpeed has no float8 training path of its own (../shared/notes/fp8_compile_offload.md §1d); torchao's
`convert_to_float8_training` swaps `nn.Linear` for `Float8Linear`, which casts input, weight and output
gradient to float8 (dynamic scales, tensorwise by default, rowwise as an option) for its three matmuls
and keeps the same bf16 `Parameter` objects. DeepSpeed's engine, optimizer and ZeRO partitioning see the
same parameters as in a bf16 run, so the conversion runs on the built model, before `deepspeed.initialize`
(which hooks the module tree), and before the layers are compiled (float8 without compile ran at 0.41x
of compiled float8: the casts must fuse).

Only decoder-layer Linears are converted: the head and the embeddings stay bf16 (the logits' precision
matters most, and the head runs inside Liger's fused loss). The filter reads in_features/out_features,
never the weight's shape, which ZeRO-3 partitions to (0,) (toolkit/plan/speedups.py `fp8_converts`).
A run that converts nothing is an error, not a silent bf16 run.
"""

from __future__ import annotations

from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.plan.speedups import fp8_converts, fp8_support_error


def check(cfg: Any, capability: tuple[int, int] | None, gpu: str = "") -> None:
    """Before the process group: everything that would make a float8 run fail or silently not be one. capability:
    the GPU's (SM major, minor), None without CUDA (toolkit/runtime/resolved.py Machine)."""
    if cfg.lora.enabled:
        raise ConfigError("train.precision=fp8 with lora.enabled: LoRA's adapter matmuls (rank "
                          f"{cfg.lora.r}) are far too small for float8 to pay, and its frozen base runs under "
                          "adapter autocast, which the float8 path is not tested with; use train.precision=bf16")
    if cfg.train.compile == "off":
        raise ConfigError("train.precision=fp8 with train.compile=off: float8 needs compile to be fast (eager "
                          "float8 ran at 0.41x of compiled float8 on llama-1b); use train.compile=auto or torch")
    if cfg.model.task != "causal_lm":
        raise ConfigError(f"train.precision=fp8 is for causal_lm models (task {cfg.model.task!r})")
    msg = fp8_support_error(capability, gpu)
    if msg:
        raise ConfigError(msg)
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        raise ConfigError(f"train.precision=fp8 needs torchao (pip install torchao): {type(e).__name__}: {e}") from None


def gpu_capability(local_rank: int) -> tuple[tuple[int, int] | None, str]:
    """(SM major, minor) and the GPU's name; NVML first, so no CUDA context exists before the process group."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(local_rank)
        name = pynvml.nvmlDeviceGetName(h)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        return (int(major), int(minor)), name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no NVML (or CUDA_VISIBLE_DEVICES remapped it away): ask torch
        import torch

        if not torch.cuda.is_available():
            return None, ""
        return torch.cuda.get_device_capability(local_rank), torch.cuda.get_device_name(local_rank)


def convert(model: Any, layers: list[Any], recipe: str) -> dict[str, Any]:
    """Swap the decoder layers' eligible Linears for torchao Float8Linear in place.

    Returns {"converted": n, "linears": m, "skipped": [names inside a layer]}. converted 0 with linears > 0:
    the size rule kept every Linear in bf16 (float8 would not pay on this model); the caller says so and
    the run is bf16. Raises when the layers hold no Linear at all, or when fewer modules were swapped than
    qualified: either would be a bf16 run under an fp8 label."""
    import torch

    def keep(mod: torch.nn.Module, fqn: str = "") -> bool:
        # type(), not isinstance: a PEFT LoRA wrapper or an already converted module is not a plain Linear
        return type(mod) is torch.nn.Linear and fp8_converts(recipe, mod.in_features, mod.out_features)

    plain = [(name, mod) for layer in layers for name, mod in layer.named_modules() if type(mod) is torch.nn.Linear]
    if not plain:
        raise ConfigError(f"train.precision=fp8: the decoder layers of {type(model).__name__} hold no nn.Linear "
                          "(GPT-2's Conv1D is not one); use train.precision=bf16")
    qualified = sum(keep(mod) for _, mod in plain)
    skipped = sorted({name for name, mod in plain if not keep(mod)})
    stats: dict[str, Any] = {"converted": 0, "linears": len(plain), "skipped": skipped}
    if not qualified:
        return stats
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    if recipe == "rowwise":
        import torch._inductor.config as inductor

        # torchtitan sets this for rowwise: without it inductor's fused casts round differently from
        # eager's (pytorch #150859)
        inductor.emulate_precision_casts = True
    config = Float8LinearConfig.from_recipe_name(recipe)
    for layer in layers:
        convert_to_float8_training(layer, module_filter_fn=keep, config=config)
    stats["converted"] = sum(isinstance(m, Float8Linear) for layer in layers for m in layer.modules())
    if stats["converted"] != qualified:
        raise RuntimeError(f"train.precision=fp8: {qualified} Linear modules qualified, {stats['converted']} were "
                           "converted; refusing to train a partly converted model")
    return stats


def describe(stats: dict[str, Any], recipe: str, n_layers: int) -> str:
    if not stats["converted"]:
        return (f"fp8: off, the run is bf16: none of the {stats['linears']} decoder-layer Linear modules is large "
                f"enough for {recipe} float8 to pay (torchao's size rule: {', '.join(stats['skipped'])})")
    skipped = f"; kept bf16 (below the size rule): {', '.join(stats['skipped'])}" if stats["skipped"] else ""
    return (f"fp8: {stats['converted']} of {stats['linears']} decoder-layer Linear modules in {n_layers} layers "
            f"converted to torchao float8 ({recipe} scaling); head and embeddings bf16{skipped}")


def hint(layers: list[Any], flops_per_token: float, hidden: int, local_rank: int) -> str | None:
    """For a bf16 run on a GPU that has float8: the predicted gain of train.precision=fp8 on this model (the
    planner's model, toolkit/plan/planner.py fp8_gain), or None where float8 would not apply."""
    import torch

    from toolkit.plan.planner import fp8_gain

    capability, _ = gpu_capability(local_rank)
    if fp8_support_error(capability) is not None or not layers:
        return None
    conv = sum(m.in_features * m.out_features for m in layers[0].modules()
               if type(m) is torch.nn.Linear and fp8_converts("tensorwise", m.in_features, m.out_features))
    if not conv:
        return None
    f = min(1.0, 6.0 * conv * len(layers) / flops_per_token)
    ratio = 1.0 / ((1 - f) + f / fp8_gain(hidden))
    return (f"fp8: off (bf16 matmuls); train.precision=fp8 is predicted {ratio:.2f}x faster on this model and GPU "
            "(float8 changes the matmuls' numerics, so it is opt-in: bench/results/fp8_compile.md)")
