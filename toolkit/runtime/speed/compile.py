"""`train.compile=torch`: each decoder layer compiled in place (`layer.compile()`; at ZeRO-3 its `forward`, the
layer a ZeRO-3 leaf module), before DeepSpeed.

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

At ZeRO-3, DeepSpeed's hooks on every submodule would split a compiled layer into a graph per module (0.74x eager);
as leaf modules the layers compile to one graph each and run as at ZeRO-2 (`mark_leaves`, `leaves_safe`).

`auto` (the default) compiles CUDA runs long enough to pay the compile back (toolkit/plan/speedups.py
`compile_on` holds the rule and the measurement behind it); CPU runs stay eager.
"""

from __future__ import annotations

from typing import Any


def decide(cfg: Any, ds: dict[str, Any], stage: int, steps: int | None, fp8: bool) -> tuple[bool, str]:
    """(compile the decoder layers or not, why): train.compile, with auto resolved for this run."""
    import torch

    from toolkit.launch import dist
    from toolkit.plan.speedups import compile_on, leaves_blocked

    cuda = torch.cuda.is_available() and not dist.on_cpu()
    return compile_on(cfg.train.compile, cuda=cuda, steps=steps, fp8=fp8, stage=stage,
                      no_leaves=leaves_blocked(lora=bool(cfg.lora.enabled), ds=ds))


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


def compile_layers(model: Any, zero3_leaves: bool = False) -> tuple[int, bool]:
    """Compile every decoder layer in place (inductor); returns (how many, whether they are ZeRO-3 leaves). Call
    after LoRA, Liger and float8 conversion (the compiled graph must see the final modules) and before
    deepspeed.initialize (ZeRO-3 reads the leaf marks when it registers its hooks). zero3_leaves: train.zero3_leaves
    resolved (toolkit/plan/speedups.py leaves_on); a model whose layers cannot be leaves (`leaves_safe`) keeps hooks."""
    import torch._dynamo

    layers = decoder_layers(model)
    if not layers:
        raise RuntimeError(f"train.compile=torch: no repeated decoder layer found in {type(model).__name__}; "
                           "set train.compile=off")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # No KV cache in training forwards: the cache's per-layer state (`past_key_values.layers[i]`) is a guard,
    # so every layer recompiled until dynamo's limit of 8 and the rest ran eager (llama-1b: layers 8-15,
    # seen on one H200). generate() asks for its own cache, and runs eager (`eager()` below).
    base.config.use_cache = False
    # Where DeepSpeed's ZeRO-3 hooks stay on every submodule, dynamo traces them inside the layer, and they guard
    # on the module's class: one entry per class of submodule, more than the default 8 on a Llama layer. Past
    # the limit a frame runs eager, and a checkpointed layer's recompute then saved other tensors than its
    # forward (CheckpointError, Qwen2 at ZeRO-3 with gradient checkpointing).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    leaves = zero3_leaves and leaves_safe(model)
    if leaves:
        mark_leaves(model, layers)
        # Only the layer's forward is compiled: DeepSpeed's hooks on the layer (gather before, release after,
        # the leaf's full backward hook that reduces its gradients) run eager around one graph per layer.
        for layer in layers:
            layer.forward = torch.compile(layer.forward)
    else:
        for layer in layers:
            layer.compile()
    return len(layers), leaves


def eager_leaves(model: Any, layers: list[Any], why: str, required: bool) -> str:
    """train.zero3_leaves at ZeRO-3 without compile: each decoder layer a leaf module (one gather and one reduce a
    layer instead of a hook on each of its submodules); returns a line for the log. Before deepspeed.initialize.
    required (train.zero3_leaves=true): a model whose layers cannot be leaves stops the run; else it keeps its hooks."""
    if not layers or not leaves_safe(model):
        what = ("the decoder layers cannot be ZeRO-3 leaf modules here (no repeated decoder layer, or the input "
                "embeddings are frozen, so the first layer's gradients would be reduced before they exist)")
        if required:
            raise RuntimeError(f"{why}: {what}; set train.zero3_leaves=false")
        return f"ZeRO-3 leaf modules: none ({what}); a hook on each submodule"
    mark_leaves(model, layers)
    return f"ZeRO-3 leaf modules: {len(layers)} x {type(layers[0]).__name__}, eager ({why})"


def plain_linear(ds: dict[str, Any]) -> str | None:
    """Under compile at ZeRO-3, leave torch's own F.linear in place (`memory_efficient_linear: false`, set in the
    DeepSpeed dict before the model is built under zero.Init, which reads it); returns a line for the log.

    DeepSpeed's replacement (deepspeed/runtime/zero/linear.py) reads `weight.ds_id` in its backward, and dynamo
    guards on the value: every decoder layer compiled its own graph (llama-1b, float8 at ZeRO-3 on one H200: 15
    recompiles, 132 s to the end of an 8-step run against 62 s at ZeRO-2). Its one purpose, gathering a weight
    that a hook missed, does not arise: the decoder layers are leaves gathered whole, or every Linear has its own
    hooks. A value the user set stays, with the cost said."""
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("memory_efficient_linear") is True:
        return ("note: zero_optimization.memory_efficient_linear=true under train.compile: DeepSpeed's linear guards "
                "on each weight's ds_id, so every decoder layer compiles its own graph (set it false to compile one)")
    if "memory_efficient_linear" not in zero:
        zero["memory_efficient_linear"] = False
    return None


def leaves_safe(model: Any) -> bool:
    """Whether the decoder layers can be ZeRO-3 leaf modules without losing gradients.

    DeepSpeed reduces a leaf's gradients in the leaf's full backward hook. When none of a module's inputs needs
    a gradient, torch calls that hook as soon as the gradient of its output arrives, before the layer's own
    weight gradients exist (torch/utils/hooks.py, BackwardHook.setup_output_hook), and DeepSpeed then reduces
    zeros. The first layer's input needs a gradient only when the input embeddings train: a full fine-tune
    (LoRA and frozen embeddings keep a hook per submodule)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    return weight is not None and bool(weight.requires_grad)


def mark_leaves(model: Any, layers: list[Any]) -> None:
    """Make each decoder layer a ZeRO-3 leaf module: one gather of the whole layer before its forward and one
    reduce after its backward, and no DeepSpeed hook inside the layer. With hooks on every Linear, dynamo broke
    each compiled layer into a graph per submodule, and the float8 casts did not fuse (llama-1b on one H200:
    51.6k tokens/s for float8 at ZeRO-3 against 80.2k at ZeRO-2; bench/results/fp8_compile.md)."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [type(layers[0])])
    _require_positional_input(layers[0])


def _require_positional_input(layer: Any) -> None:
    """Stop at the first training forward of a model that passes the hidden states to its decoder layers by keyword.

    torch's full backward hook counts positional inputs only, so such a layer looks to it like one whose input
    needs no gradient: the leaf's gradients would be reduced before they exist, and training would go on with
    zeros (the case `leaves_safe` rules out by the embeddings; the transformers models the toolkit knows pass
    them positionally). A one-shot pre-hook: removed after the first forward with gradients on."""
    import torch

    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        handle.remove()
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            by_name = ", ".join(sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad))
            what = f"receives {by_name} by keyword" if by_name else "has no positional input that needs a gradient"
            raise RuntimeError(
                f"ZeRO-3 leaf modules: {type(module).__name__} {what}; as a ZeRO-3 leaf module its gradients would "
                "be reduced before they exist (torch's full backward hook sees positional inputs only). "
                "Set train.zero3_leaves=false")

    handle = layer.register_forward_pre_hook(check, with_kwargs=True)


RECOMPILE_LIMIT = 64


def eager() -> Any:
    """Context: compiled layers run eager inside (generation: one token at a time over a growing cache, shapes
    and cache states that would each compile anew)."""
    import torch

    return torch.compiler.set_stance("force_eager")


def describe(n_layers: int, layer: Any, why: str, leaves: bool = False) -> str:
    where = "; each a ZeRO-3 leaf module (one gather and one reduce per layer)" if leaves else ""
    return (f"torch.compile: {n_layers} x {type(layer).__name__} compiled in place (inductor; {why}){where}; "
            "the first optimizer step includes compiling one layer, which the others reuse")
