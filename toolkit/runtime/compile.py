"""`train.compile=torch`: each decoder layer compiled in place (`layer.compile()`), before DeepSpeed.

Why per layer, in place, and before `deepspeed.initialize` (../shared/notes/fp8_compile_offload.md §2):
- `module.compile()` keeps the module and its parameter names: checkpoints, resume, export and
  generation see the model they would see eagerly (no `_orig_mod.` prefix).
- The decoder layers of a model are one class with the same code, so inductor compiles one layer's
  graph and every other layer reuses it: a 16-layer model pays one layer's compile, not the model's.
- What sits between the layers (embeddings, the loss, DeepSpeed's ZeRO-3 hooks on the model) stays
  eager. `engine.compile()` compiles the whole model instead: on llama-1b it ran at 57.4k tokens/s
  against 66.8k per layer (../shared/anchors.md), and with Liger's kernels it crashed.
- Liger's RMSNorm, SwiGLU and RoPE kernels inside a compiled layer crash inductor (Triton
  `CompilationError: 'float' object has no attribute 'to'`, then an illegal memory access; Liger
  #1364/#1366, pytorch #170049). Inductor fuses those three itself, so under compile the toolkit keeps
  only Liger's fused loss, which runs in the model's forward, outside the layers
  (toolkit/plan/liger.py).

`auto` (the default) compiles CUDA runs long enough to pay the compile back (toolkit/plan/liger.py
`compile_on` holds the rule and the measurement behind it); CPU runs stay eager.
"""

from __future__ import annotations

from typing import Any


def decide(cfg: Any, model_type: str, stage: int, steps: int | None, fp8: bool) -> tuple[bool, str]:
    """(compile the decoder layers or not, why): train.compile, with auto resolved for this run."""
    import torch

    from toolkit.launch import dist
    from toolkit.plan.speedups import compile_on
    from toolkit.runtime import kernels

    cuda = torch.cuda.is_available() and not dist.on_cpu()
    eager_liger = kernels.choice_for(cfg, model_type, stage)
    return compile_on(cfg.train.compile, cuda=cuda, steps=steps, fp8=fp8,
                      liger_layers=bool(eager_liger.kwargs.get("rms_norm")))


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a Hugging Face model (under LoRA: of its base model), in order.

    The blocks are the children of a ModuleList that all share one class (LlamaDecoderLayer, Qwen2DecoderLayer,
    GPT2Block, BertLayer). transformers names such classes in `_no_split_modules` (with others that do not
    repeat, such as BertEmbeddings), so a list of those is preferred; otherwise the list holding the most
    parameters.
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    lists = [m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0
             and len({type(c) for c in m}) == 1]
    named = [m for m in lists if type(m[0]).__name__ in names]
    pool = named or lists
    if not pool:
        return []
    return list(max(pool, key=lambda m: sum(p.numel() for p in m.parameters())))


def compile_layers(model: Any) -> int:
    """Compile every decoder layer in place (inductor); returns how many. Call after LoRA, Liger and
    float8 conversion (the compiled graph must see the final modules) and before deepspeed.initialize."""
    layers = decoder_layers(model)
    if not layers:
        raise RuntimeError(f"train.compile=torch: no repeated decoder layer found in {type(model).__name__}; "
                           "set train.compile=off")
    for layer in layers:
        layer.compile()
    return len(layers)


def describe(n_layers: int, layer: Any, why: str) -> str:
    return (f"torch.compile: {n_layers} x {type(layer).__name__} compiled in place (inductor; {why}); "
            "the first optimizer step includes compiling one layer, which the others reuse")
