"""The whole ZeRO-3 model gathered once for generation, where it fits; the decision every rank shares.

Generating through the sharded model gathers every layer from every rank for every new token (and, with
synced_gpus, for every rank's every prompt). Gathering all parameters once, generating with DeepSpeed's
hooks off and partitioning again afterwards costs one all-gather per call: TRL's and DeepSpeed's
`unwrap_model_for_generation` do the same. It needs the model's full size free on every rank, so it is
chosen by a memory check, and every rank takes the same path (one rank's gather is a collective the
others must join).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from toolkit.config.models import per_layer, text_config
from toolkit.launch import dist
from toolkit.plan.generation import MAX_BATCH, DecodeShape, batch_that_fits, bytes_per_sequence
from toolkit.runtime.generation.guard import unwrap

GIB = 1024**3
RESERVE_CUDA = 1 * GIB  # the CUDA allocator's fragmentation and the library workspaces
# Tests only: "RANK:BYTES" makes that rank see BYTES free, as if its GPU were full (tests/dist/test_generate.py).
FAULT_ENV = "TOOLKIT_FAULT_GEN_FREE_BYTES"


@dataclass(frozen=True)
class Choice:
    gathered: bool
    """The whole model gathered once (else: layer by layer, synced_gpus where ZeRO-3 runs on >1 rank)."""
    batch_size: int
    """Prompts per generate call on this rank."""
    reason: str
    zero3: bool = True

    @property
    def path(self) -> str:
        if not self.zero3:
            return "whole model"
        return "whole-model gather" if self.gathered else "layer by layer"


def decode_shape(mc: Any) -> DecodeShape:
    mc = text_config(mc)  # composite (vision-language) configs
    hidden = int(getattr(mc, "hidden_size", None) or mc.n_embd)
    heads = int(getattr(mc, "num_attention_heads", None) or mc.n_head)
    layers = int(getattr(mc, "num_hidden_layers", None) or mc.n_layer)
    # head dims set per layer (Gemma 4's full-attention layers at 512): the mean, so the KV cache sums right
    dims = [d or hidden // heads for d in per_layer(mc, "head_dim", layers)]
    return DecodeShape(
        layers=layers,
        hidden=hidden,
        intermediate=int(getattr(mc, "intermediate_size", None) or getattr(mc, "n_inner", None) or 4 * hidden),
        heads=heads,
        kv_heads=int(getattr(mc, "num_key_value_heads", None) or heads),
        head_dim=-(-sum(dims) // layers),
        vocab=int(mc.vocab_size),
    )


def gathered_bytes(model: Any) -> int:
    """What gathering every ZeRO-3 parameter adds on this rank: each parameter's full size (its shard stays)."""
    return sum(int(p.ds_numel) * p.element_size() for p in model.parameters() if hasattr(p, "ds_numel"))


def free_bytes() -> int:
    """Free memory where the generation runs: the GPU's free bytes plus what PyTorch's cache holds unused;
    off CUDA the host's available memory."""
    fault = os.environ.get(FAULT_ENV)
    if fault:
        rank, _, value = fault.partition(":")
        if int(rank) == dist.rank():
            return int(value)
    if dist.on_cpu():
        import psutil

        return int(psutil.virtual_memory().available)
    import torch

    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def choose(
    model: Any,
    mc: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    zero3: bool,
    gather: str,
    batch_size: int | str,
    width_multiple: int = 1,
) -> Choice:
    """Gather or not, and the batch size, from this rank's free memory; collective under ZeRO-3.

    `gather`: auto (gather where every rank fits), true (gather; the check only reports), false (layer by
    layer). `batch_size`: an int, or auto (what fits, at most MAX_BATCH).
    """
    dtype_bytes = next((p.element_size() for p in unwrap(model).parameters()), 4)
    longest = -(-max((len(p) for p in prompts), default=1) // width_multiple) * width_multiple
    per_seq = bytes_per_sequence(decode_shape(mc), longest, max_new_tokens, dtype_bytes, not dist.on_cpu())
    need = gathered_bytes(unwrap(model)) if zero3 else 0
    free = free_bytes()
    reserve = 0 if dist.on_cpu() else RESERVE_CUDA
    # Free memory after the gathered copy, for the batch: 90% of it, the rest left to the allocator.
    room = int(0.9 * free) - need - reserve
    # a batch size given: all of it must fit beside the gathered model; auto: at least one sequence
    fixed = None if batch_size == "auto" else max(1, min(int(batch_size), len(prompts) or 1))
    fits = room >= per_seq * (fixed or 1)
    gathered = zero3 and gather != "false"
    if zero3 and gather == "auto":
        # One rank that does not fit decides for all: a gather is a collective every rank must join.
        gathered = _all_ranks(fits)
    budget = room if gathered else int(0.9 * free) - reserve
    size = fixed or max(1, batch_that_fits(budget, per_seq, len(prompts), MAX_BATCH))
    if not zero3:
        reason = "the model is whole on every rank (no ZeRO-3)"
    elif gather == "false":
        reason = "eval.generate_gather=false"
    elif gather == "true":
        reason = f"eval.generate_gather=true ({_gib(need)} GiB gathered, {_gib(free)} GiB free on rank {dist.rank()})"
    elif gathered:
        reason = f"{_gib(need)} GiB gathered + {_gib(per_seq)} GiB per sequence fit {_gib(free)} GiB free"
    elif fits:
        reason = "another rank has no room for the gathered model"
    else:
        reason = (f"{_gib(need)} GiB gathered + {_gib(per_seq)} GiB per sequence x {fixed or 1} exceed "
                  f"{_gib(free)} GiB free")
    return Choice(gathered=gathered, batch_size=size, reason=reason, zero3=zero3)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _all_ranks(flag: bool) -> bool:
    return dist.all_reduce_sum([0.0 if flag else 1.0])[0] == 0


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """torch.nn.functional.linear as torch ships it, for the length of a generation.

    `deepspeed.zero.Init` replaces it process-wide with ZeRO-3's memory-saving autograd function ("This will
    persist unless manually reset"), which only matters for a backward. Under no_grad it costs: a whole-model
    decode of llama-1b at batch 128 ran at 1,403 tokens/s with it and 4,697 without (bench/results/generate/).
    The patch is put back on the way out, so training runs as before.
    """
    import torch.nn.functional as F

    zero_init = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero_init, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    patched = F.linear
    if original is None or patched is original:
        yield
        return
    F.linear = original
    try:
        yield
    finally:
        F.linear = patched


def _keep_own_hooks(module: Any) -> None:
    """Drop a module's forward hooks but the toolkit's own (the attention's pick of the packed or plain kernel,
    attention/interface.py: without it a model last run on packed rows would keep the maskless varlen kernel, and
    left-padded rows would attend to their padding)."""
    hooks = [getattr(module, n) for n in ("_forward_pre_hooks", "_forward_hooks") if hasattr(module, n)]
    keep = {i for d in hooks for i, fn in d.items() if str(getattr(fn, "__module__", "")).startswith("toolkit.")}
    for name in HOOK_DICTS:
        d = getattr(module, name, None)
        if d is not None:
            for i in [i for i in d if i not in keep]:
                del d[i]


HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


@contextlib.contextmanager
def whole_model(engine: Any) -> Iterator[Any]:
    """Every ZeRO-3 parameter gathered on every rank, and no forward hook on any module inside; partitioned, and
    every hook back as it was, on the way out. Collective: every rank enters and leaves together.

    DeepSpeed's own `unwrap_model_for_generation` removes only ZeRO's per-module hooks and registers new ones after.
    That leaves the engine's hooks on the root module, whose forward-start hook runs
    `assert_ints_same_as_other_ranks` (a broadcast) on every forward while the parameter trace is being recorded:
    a collective inside generation, where ranks run different numbers of forwards, and a rank with no prompt runs
    none. Its re-registration also invalidates the trace the training steps recorded. So the hooks are set aside
    (the same dict objects, emptied and refilled: their handles stay valid) instead. Parameters that a module
    still lists as in use (`ds_active_sub_modules`) would fail the re-partition (trl#2840); TRL clears them, as
    here.
    """
    import deepspeed

    params = list(engine.parameters())
    for p in params:
        active = getattr(p, "ds_active_sub_modules", None)
        if active:
            active.clear()
    modules = list(unwrap(engine).modules())
    with deepspeed.zero.GatheredParameters(params):
        saved = [[dict(getattr(m, name)) for name in HOOK_DICTS if hasattr(m, name)] for m in modules]
        for m in modules:
            _keep_own_hooks(m)
        # ZeRO-3's parameter dicts (ZeROOrderedDict) run a Python getter on every parameter read, which fetches
        # parameters a module's forward did not announce; every parameter is here already, so plain dicts stand in
        # for them while generating: no getter for each read, nothing of ZeRO's for a compiled decode step to trace
        zero_dicts = [(m, m._parameters) for m in modules if type(m._parameters) is not dict]
        for m, d in zero_dicts:
            m._parameters = dict(d.items())
        try:
            yield unwrap(engine)
        finally:
            for m, d in zero_dicts:
                m._parameters = d
            for m, dicts in zip(modules, saved, strict=True):
                for name, kept in zip([n for n in HOOK_DICTS if hasattr(m, n)], dicts, strict=True):
                    getattr(m, name).clear()
                    getattr(m, name).update(kept)
