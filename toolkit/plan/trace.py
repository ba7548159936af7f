"""What a decoder layer saves for backward, read from the model's own code: one forward of a few layers on fake
tensors (no memory, no GPU, about a second), counting the storages autograd keeps (`saved_tensors_hooks`).

Why a trace and not a formula per family: a formula is right only for the family it was counted on. Qwen3's q/k norms
keep 26% more than the Llama formula says, Phi-3 copies its attention output, Gemma has four norms a layer
(../shared/notes/generic_planner.md). The trace reproduces the Llama layer that was checked on a GPU (108,680 bytes a
token against 108.7 kB measured, bench/results/anatomy.md) and reads any other family the same way.

What the trace cannot see on a CPU it substitutes (each a small autograd.Function that saves what the real kernel
saves, so the count stays the count of storages):
- attention: `scaled_dot_product_attention` saves q, k, v, its output and an fp32 log-sum-exp per query and head, as
  CUDA's flash and memory-efficient kernels do (on the CPU a masked call falls back to the math kernel, S x S);
- Liger's kernels (Triton, not runnable on fake tensors): its RMSNorm keeps its input and an fp32 rstd per row
  (LigerRMSNormFunction), its SwiGLU/GeGLU MLP keeps gate and up outputs (LigerSiLUMulFunction).
Kept whole per variant: {plain, liger} x {full fine-tune, frozen base} in bytes per token, split by the layer's
children (attention, MLP, norms) so tiled MLPs can swap the MLP's share, plus every Linear's input (which storage it
is, whether anything else keeps it) so LoRA on any set of targets is counted without tracing PEFT (which cannot run
on fake tensors), and eager attention's bytes per token at two lengths (its S x S term).

Code that reads its tensors' values (MoE routing counts, unpadding by `.item()`) cannot run on fake tensors; where
the copy is small (REAL_MAX_PARAMS), it is traced on real, uninitialized CPU tensors instead, counted the same way
(tests/unit/test_trace.py holds the two counts equal on a Llama). An MoE whose copy is larger is traced at two small
expert counts and read at its own on the line through them (`_fewer_experts`; JetMoE, Qwen4-Exp), and a copy larger
still (up to VIRTUAL_MAX_PARAMS) on real tensors without its matmuls, whose weights are then never read
(LongCat-Flash).

Pitfalls handled (the note's): transformers treats fake tensors as tracing and builds a 4-D mask for an unpacked batch
(`find_packed_sequence_indices` is answered None while tracing); the meta device is never used (no fused attention).
And: every parameter is bf16, as DeepSpeed's bf16 makes it, whatever dtype a family creates it in (`_bf16_params`); a
module that converts its own parameters while built gets new ones (`_fake_conversion`); weights are never initialized
(an init that reads values cannot run on fake tensors); the parameters and buffers stay alive through the forward, so
no storage made later is taken for one a family replaced (CTRL's positional table, cast in its forward).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

TRACE_VERSION = 1
TRACE_SEQ = 256  # bytes per token do not depend on the length with fused attention (the note: 256 to 2,048 equal)
EAGER_SEQS = (256, 512)  # eager attention's S x S term: two lengths give its slope
MIDDLE = 3  # layers traced besides a first and a last (a layer owns the storages its code makes: the first counts)


# (token ids, attention, attention mask given): the ways a family's stack is run, the first that runs
WAYS = tuple((ids, attn, mask) for ids in (False, True) for attn, mask in (("sdpa", False), ("sdpa", True), ("eager", True)))
DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException")
# a copy traced on real CPU tensors: 1.4 GB of bf16 weights at most (DBRX's 5-layer copy, 616M, traced in 4 s at
# 1.8 GB of RSS; JetMoE's, 1,893M, is traced with fewer experts: _fewer_experts)
REAL_MAX_PARAMS = 700_000_000
# a larger copy is traced on real tensors without its matmuls (_creators: each takes an empty output of its shape), so
# its weights are never read and their pages never touched: address space, not memory. 16 GB of bf16 address space
# at most (LongCat-Flash's copies with 12 and 13 of its 512 experts: 4.9B and 5.2B parameters, 0.3 GB of RSS)
VIRTUAL_MAX_PARAMS = 8_000_000_000


class TraceError(RuntimeError):
    """The model's code could not run on fake tensors (a data-dependent shape, a custom kernel)."""


def trace_layers(mc: Any, kinds: list[Any] | None = None, shared: frozenset[Any] = frozenset()) -> dict[str, Any]:
    """Trace a causal LM described by the HF config `mc` (a copy with a few layers is built on fake tensors).

    kinds: each decoder layer's parameter list (name, numel) in the full model, where its layers differ (DeepSeek-V3's
    dense first layers, a hybrid's attention and recurrent layers): the copy then holds every kind, and each figure is
    the mean over the full model's layers (kinds' bytes weighted by their counts), so num_layers x layer is the stack.
    shared: the kinds whose later layers share parameters with the first of them (Zamba's hybrid layers).

    Returns {"version", "layer": {variant: bytes/token}, "parts": {variant: {child: bytes/token}},
    "final": {variant: bytes/token}, "linears": [[name, in_features, group, kept_by_frozen]], "eager": [a, b]}
    where variant is "<plain|liger>-<full|frozen>" and eager attention adds a + b x seq_len bytes a token; "attention":
    "eager" where the family has no fused path (its bytes were traced at TRACE_SEQ and grow by b a token per token).
    Where a layer runs other than once a forward, "calls": [calls, calls with gradients], a layer's mean (HRM's cycles:
    [4, 2.5]; its "layer" bytes are all its calls'); reversible layers (no call with gradients: Reformer) are [2, 1] and
    add "recompute": {variant: bytes/token}, the largest part of one layer run again with gradients in backward.
    """
    n = _layer_count(mc, kinds, shared)
    try:
        return _trace_all(mc, n, kinds, real=False)
    except TraceError as e:
        # code that reads its tensors' values (MoE routing counts with .tolist(), unpadding by .item()) cannot run on
        # fake tensors: a copy small enough is traced on real (uninitialized) CPU tensors instead, the same counting
        if not str(e).startswith(DATA_DEPENDENT):
            raise
        params = _copy_params(mc, n)
        if params > REAL_MAX_PARAMS:
            fewer = _fewer_experts(mc, n, kinds)
            if fewer is not None:
                return fewer
        if params > VIRTUAL_MAX_PARAMS:
            raise TraceError(f"{e}; its code reads its tensors' values, and a copy of {n} layers ({params / 1e6:,.0f}M "
                             f"parameters) is too large to trace on real CPU tensors (at most "
                             f"{VIRTUAL_MAX_PARAMS / 1e6:,.0f}M; a copy with fewer experts is made only of an MoE with "
                             "ungrouped experts, where it fits)") from None
        return _trace_all(mc, n, kinds, real=True, compute=params <= REAL_MAX_PARAMS)
    return _trace_all(mc, n, kinds, real=True)


def _fewer_experts(mc: Any, n: int, kinds: list[Any] | None) -> dict[str, Any] | None:
    """An MoE too large to trace on real tensors, traced at two small expert counts, top-k and top-k + 1, and read at
    its own count on the line through them; None where it has no such count or those copies are still too large.

    Why a line: a token is routed to top-k experts whatever their number, so what the experts save sums to the same
    bytes a token (sum of their token counts = tokens x top-k); what grows with the count is the router's (logits,
    probabilities, one-hot masks), E values a token each. The copies also take a small vocabulary: from
    inputs_embeds, the layers never see it (test_trace holds both against a full trace)."""
    name = next((k for k in EXPERT_COUNTS if isinstance(vars(mc).get(k), int)), None)
    top_k = next((vars(mc)[k] for k in TOP_K if isinstance(vars(mc).get(k), int)), 0)
    if name is None or not 0 < top_k < getattr(mc, name) - 1 or (vars(mc).get("n_group") or 1) > 1:
        # no expert count, too few to cut, or experts in groups (the count must divide by them)
        return None
    counts = (top_k, top_k + 1)
    traces = []
    for count in counts:
        cfg = _small_vocab(copy.deepcopy(mc))
        setattr(cfg, name, count)
        if vars(cfg).get("zero_expert_num"):
            # LongCat-Flash's zero-computation (identity) experts, which its code gives weights too: left out of the
            # copies, so every routed slot goes to a real expert, which keeps more than an identity's product: an
            # upper bound (its real router sends a learned share of slots to them)
            cfg.zero_expert_num = 0
        params = _copy_params(cfg, n)
        if params > VIRTUAL_MAX_PARAMS:
            return None
        traces.append(_trace_all(cfg, n, _kinds_as_built(cfg, kinds), real=True, compute=params <= REAL_MAX_PARAMS))
    t = (getattr(mc, name) - counts[0]) / (counts[1] - counts[0])
    out = traces[0] | {k: _on_line(traces[0][k], traces[1][k], t) for k in ("layer", "parts", "final", "eager")}
    out["experts_traced"] = list(counts)
    return out


def _kinds_as_built(cfg: Any, kinds: list[Any] | None) -> list[Any] | None:
    """The full model's layer kinds (unlike layers: each one's parameter list) as `cfg`, the same model with fewer
    experts, builds them (on the meta device: no memory), for the trace to weigh its copy's layers by."""
    if not kinds:
        return None
    model = _meta_model(cfg)
    base = getattr(model, model.base_model_prefix, model)
    return [tuple((name, p.numel()) for name, p in layer.named_parameters())
            for layer in _decoder_layers(base, len(kinds))]


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # the routed experts' count, by family
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
SMALL_VOCAB = 1024


def _on_line(a: Any, b: Any, t: float) -> Any:
    """a + t (b - a), through dicts (a child one trace lacks is 0 there) and lists of numbers."""
    if isinstance(a, dict):
        return {k: _on_line(a.get(k, 0.0), b.get(k, 0.0), t) for k in a | b}
    if isinstance(a, list):
        return [_on_line(x, y, t) for x, y in zip(a, b, strict=True)]
    return a + t * (b - a)


def _small_vocab(cfg: Any) -> Any:
    """`cfg` with SMALL_VOCAB tokens, or as many as its special token ids need: the trace runs its stack from
    embeddings (or embeds ids without autograd), so the vocabulary is only the embedding's and head's parameters."""
    ids = [int(i) for k, v in vars(cfg).items() if k.endswith("_token_id") and v is not None
           for i in (v if isinstance(v, (list, tuple)) else [v])]
    cfg.vocab_size = min(int(cfg.vocab_size), max([SMALL_VOCAB, *(i + 1 for i in ids)]))
    return cfg


def _copy_params(mc: Any, n: int) -> int:
    """Parameters of the n-layer copy the trace builds."""
    return sum(p.numel() for p in _meta_model(small_config(mc, n)).parameters())


def _meta_model(cfg: Any) -> Any:
    """The causal LM of `cfg` on the meta device (no memory, no weight init)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights(), quiet_transformers():
        return AutoModelForCausalLM.from_config(cfg)


def _trace_all(mc: Any, n: int, kinds: list[Any] | None, *, real: bool, compute: bool = True) -> dict[str, Any]:
    """Every variant's trace of the n-layer copy; on real tensors (real) with or without its matmuls run (compute)."""
    out: dict[str, Any] = {"version": TRACE_VERSION, "layer": {}, "parts": {}, "final": {}}
    try:
        # how this family runs on fake tensors: as most do, or with an attention mask given, or only with its own
        # (eager) attention, whose mask MPT builds itself; each from its embeddings, or else from token ids, where the
        # stack takes no embeddings (CPM-Ant) or its layers read the ids too (DeepSeek-V4's hash-routed experts)
        failed: Exception | None = None
        # stacks of their own widths (BLT): from token ids, which its hash embeddings read (inputs_embeds skips them)
        ways = tuple(w for w in WAYS if w[0]) if stack_configs(mc) else WAYS
        for ids, attn, mask in ways:
            try:
                first = _trace(mc, n, kinds, seq=TRACE_SEQ, liger=False, full=True, attn=attn, mask=mask, real=real,
                               ids=ids, compute=compute)
                break
            except TraceError:
                raise
            except Exception as e:
                failed = failed or e  # the first way's failure says most
                if (ids, attn, mask) == ways[-1]:
                    raise failed from None
        for liger in (False, True):
            for full in (True, False):
                key = f"{'liger' if liger else 'plain'}-{'full' if full else 'frozen'}"
                r = first if (liger, full) == (False, True) else _trace(
                    mc, n, kinds, seq=TRACE_SEQ, liger=liger, full=full, attn=attn, linears=not liger and not full,
                    mask=mask, real=real, ids=ids, compute=compute)
                out["layer"][key], out["parts"][key], out["final"][key] = r["layer"], r["parts"], r["final"]
                if "linears" in r:
                    out["linears"] = r["linears"]
        if "stacks" in first:  # stacks of their own widths: what the planner reads per stack and per module
            full = [len(stack) for _, stack in trained_stacks(_meta_model(mc))]
            out["stacks"] = [[layers, *rest] for layers, rest in zip(full, first["stacks"], strict=True)]
            out["shares"] = first["shares"]
            if "patch_size" in vars(mc):
                out["patch_bytes"] = patch_bytes(mc)
        if first["calls"] != [1.0, 1.0]:  # layers run more than once a forward (HRM's cycles; some without gradients)
            out["calls"] = first["calls"]
        if first["calls"][1] == 0 < first["calls"][0]:
            # no layer ran with gradients, yet the model trains: reversible layers (Reformer), which backward runs again
            # with gradients, one at a time, from their outputs. Each layer then runs twice, once with gradients, and
            # what one layer's recompute saves exists only while its backward runs: traced with gradients forced on,
            # the largest of a layer's children (Reformer recomputes and runs backward through its feed-forward, frees
            # it, then its attention)
            out["calls"] = [2.0, 1.0]
            out["recompute"] = {
                f"{'liger' if liger else 'plain'}-{'full' if full else 'frozen'}": _trace(
                    mc, n, kinds, seq=TRACE_SEQ, liger=liger, full=full, attn=attn, mask=mask, real=real, ids=ids,
                    compute=compute, grads=True)["largest_part"]
                for liger in (False, True) for full in (True, False)}
        seqs = _eager_seqs(mc, real)
        eager = [_trace(mc, n, kinds, seq=s, liger=False, full=True, attn="eager", mask=mask, real=real,
                        ids=ids, compute=compute)["layer"] for s in seqs]
    except TraceError:
        raise
    except Exception as e:  # the model's own code failed on fake tensors
        raise TraceError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    slope = (eager[1] - eager[0]) / (seqs[1] - seqs[0])
    base = eager[0] - slope * seqs[0]
    out["eager"] = [base - out["layer"]["plain-full"], slope]
    # a family whose layers compute attention themselves (eager only): its bytes grow with the length whatever is asked
    out["attention"] = "eager" if abs(eager[0] - out["layer"]["plain-full"]) < 1 and slope > 0 else "fused"
    if real:
        out["real_tensors"] = True if compute else "without matmuls"
    return out


def _eager_seqs(mc: Any, real: bool) -> tuple[int, int]:
    """The two lengths eager attention's slope is read at. Real tensors check their indices, so a model with learned
    positions too few for the longer one (X-MOD: 512, offset by its padding index) is read at half of each instead."""
    limit = getattr(mc, "max_position_embeddings", None)
    if real and isinstance(limit, int) and limit < EAGER_SEQS[1] + 2:
        return EAGER_SEQS[0] // 2, EAGER_SEQS[1] // 2
    return EAGER_SEQS


def _layer_count(mc: Any, kinds: list[Any] | None, shared: frozenset[Any] = frozenset()) -> int:
    """Layers to build: MIDDLE + 2, at least two of every layer type of the config's own pattern, and where the layers'
    parameters differ, as many as the full model needs to show each kind once, and twice each kind whose later layers
    share a block with its first (Zamba's hybrid layers: a model with one has nothing to tie its block to)."""
    if stack_configs(mc):  # each stack cut on its own (small_config): a first, MIDDLE and a last layer a stack
        return 2 + MIDDLE
    types = getattr(mc, "layer_types", None)
    cycle = len(dict.fromkeys(types)) if types else 1
    n = 2 + max(MIDDLE, 2 * cycle)
    if kinds and len(set(kinds)) > 1:
        n = max(n, 1 + max(kinds.index(k) for k in set(kinds)))
        for k in shared:
            n = max(n, 1 + [i for i, x in enumerate(kinds) if x == k][1])
    return n


def sublayers(mc: Any) -> int:
    """What num_hidden_layers counts in each decoder layer the model builds: 1, or LongCat-Flash's 2 (its two
    attention sublayers a layer: num_hidden_layers is a property, twice its num_layers)."""
    per = getattr(type(mc), "num_hidden_layers", None)
    count = vars(mc).get("num_layers")
    if isinstance(per, property) and isinstance(count, int) and count > 0:
        return max(1, int(mc.num_hidden_layers) // count)
    return 1


def per_stack(mc: Any) -> int | None:
    """Layers a stack where the model runs several stacks of layers in turn (HRM's low- and high-level stacks, each
    of `num_layers_per_stack`: its num_hidden_layers counts its cache slots, a layer's calls a forward), else None."""
    count = vars(mc).get("num_layers_per_stack")
    return count if isinstance(count, int) and count > 0 else None


def stack_configs(mc: Any) -> list[str]:
    """The sub-configs that each build a stack of layers of its own width and count, where the model's own config
    counts no layers (BLT: its patcher, local encoder, global transformer and local decoder); [] for any other."""
    if getattr(mc, "num_hidden_layers", None) is not None:
        return []
    return [k for k in (getattr(mc, "sub_configs", None) or {})
            if isinstance(getattr(getattr(mc, k, None), "num_hidden_layers", None), int)]


def trained_stacks(model: Any) -> list[tuple[str, Any]]:
    """(name, ModuleList) of every stack of decoder layers a model of stack_configs trains, in module order: the lists
    of transformers' GradientCheckpointingLayer whose parameters the model builds trainable (BLT's local encoder,
    global transformer and local decoder; not its patcher, frozen at build, nor its cross-attention lists)."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.ModuleList) and len(mod) and all(isinstance(x, GradientCheckpointingLayer)
                                                                         for x in mod)
            and all(p.requires_grad for p in mod.parameters())]


BESIDE = "beside."  # the part name prefix of a module run beside a layer, outside it (_beside_layers)


def patch_bytes(mc: Any) -> int:
    """The bytes a patch a model of byte patches (BLT) is traced at: its config's patch_size where its entropy patcher
    picks the patches in forward (the mean length its threshold is set for: BLT's paper reports about 4.5 bytes), 1
    where it has none (transformers' BLT then makes every byte a patch). A patcher picks them from the data: a row of
    higher entropy makes more patches (at most one a byte), and a patcher at random init makes one a byte; the plan's
    caveat says so (planner.speed_caveat)."""
    entropy = getattr(mc, "patch_in_forward", False) and getattr(mc, "patching_mode", None) == "entropy"
    return max(1, int(mc.patch_size or 1)) if entropy else 1


def small_config(mc: Any, layers: int) -> Any:
    """`mc` with `layers` decoder layers (as the model builds them: sublayers); every per-layer list of the config (layer_types, a hybrid's pattern string,
    Gemma 3n's MLP widths) keeps the model's own interleaving, cut or repeated to the new count."""
    cfg = copy.deepcopy(mc)
    stacks = stack_configs(cfg)
    if stacks:  # each stack with at most `layers` (BLT's one-layer local encoder keeps its one)
        for name in stacks:
            sub = getattr(cfg, name)
            sub.num_hidden_layers = min(int(sub.num_hidden_layers), layers)
        return cfg
    if per_stack(cfg):  # each stack with `layers` (HRM: its cache slots follow, as its config derives them)
        slots = int(cfg.num_hidden_layers) // cfg.num_layers_per_stack
        cfg.num_layers_per_stack, cfg.num_hidden_layers = layers, layers * slots
        return cfg
    full = int(cfg.num_hidden_layers)
    cfg.num_hidden_layers = layers = layers * sublayers(cfg)
    for name, value in list(vars(cfg).items()):
        per_layer = isinstance(value, (list, tuple, str)) and any(
            w in name for w in ("layer", "pattern", "block", "intermediate_size"))  # Gemma 3n's MLP widths
        if per_layer and len(value) == full and full > 1:
            cut = [value[i % full] for i in range(layers)]
            with contextlib.suppress(AttributeError):  # derived from other fields in some configs
                setattr(cfg, name, "".join(cut) if isinstance(value, str) else type(value)(cut))
    # the last layers that reuse an earlier layer's keys and values (Gemma 3n's num_kv_shared_layers): as many in
    # proportion, leaving before them a layer of every type (a shared layer reads the last one of its type)
    shared = vars(cfg).get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0 and full > layers:
        types = list(getattr(cfg, "layer_types", None) or [])
        k = max(1, round(shared * layers / full))
        while k > 1 and types and set(types[:layers - k]) != set(types):
            k -= 1
        cfg.num_kv_shared_layers = k
    for name in ("num_blocks",):  # the count some configs build from beside num_hidden_layers (xLSTM)
        if vars(cfg).get(name) == full:
            setattr(cfg, name, layers)
    for name, value in list(vars(cfg).items()):  # lists of layer ids (MLP-only layers, a hybrid's attention layers)
        if (name == "mlp_only_layers" or name.endswith("layer_ids")) and isinstance(value, (list, tuple)) and value:
            setattr(cfg, name, type(value)(i for i in value if i < layers))
    return cfg


def _build(cfg: Any, attn: str) -> Any:
    """The model on fake tensors with `attn`; a family without sdpa (Gemma 2's softcapping, gpt-oss's sinks) gets the
    flash-like function through transformers' AttentionInterface, which its layers call the same way."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    except ValueError as e:
        if attn != "sdpa" or "scaled_dot_product_attention" not in str(e):
            raise
    _register_flash_like()
    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=FLASH_LIKE)
    except (KeyError, ValueError):  # older code with its own attention classes: eager, which the trace then measures
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")


def _trace(mc: Any, n: int, kinds: list[Any] | None, *, seq: int, liger: bool, full: bool, attn: str,
           linears: bool = False, mask: bool = False, real: bool = False, ids: bool = False,
           compute: bool = True, grads: bool = False) -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import no_init_weights

    cfg = _at_length(_training_config(small_config(mc, n)), seq)
    with no_init_weights(), (contextlib.nullcontext() if real else FakeTensorMode()), quiet_transformers(), \
            _no_packed_mask():
        with _fake_conversion():
            model = _build(cfg, attn)
        _bf16_params(model)
        base = getattr(model, model.base_model_prefix, model)
        widths = bool(stack_configs(cfg))
        named_stacks = trained_stacks(base) if widths else []  # read before the parameters are frozen below
        if widths:  # stacks of their own widths and counts (BLT): every trained stack, in order
            layers = [layer for _, stack in named_stacks for layer in stack]
            stack_sizes = [len(stack) for _, stack in named_stacks]
        else:
            layers = _decoder_layers(base, n, stacked=per_stack(cfg) is not None)
            stack_sizes = [n] * (len(layers) // n)
        n = len(layers)
        for p in model.parameters():
            if p.requires_grad:  # what the model freezes at build stays frozen (BLT's patcher)
                p.requires_grad_(full)
        if liger:
            _liger_like(base)  # the layers' norms and MLPs and the final norm, as Liger patches the instance
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        params |= {b.untyped_storage()._cdata for b in model.buffers()}
        where: list[tuple[int, str] | None] = [None]
        owner: dict[int, tuple[tuple[int, str] | str, int]] = {}
        # the parameters and buffers alive to the end: a buffer the forward replaces (CTRL's positional table, cast to
        # the embeddings' dtype) would free its storage, and a storage made later at its address be taken for it
        keep: list[Any] = [*model.parameters(), *model.buffers()]
        done = [False]
        created: dict[int, int | str] = {}  # storage -> the layer whose code made it ("stack", "final": outside them)

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            key = st._cdata
            if key not in params and key not in owner:
                # a storage belongs to the layer that made it: a layer's output saved by the next layer's norm (or
                # the final norm) is its own, and what the stack makes before the layers (rotary tables, the
                # embedding output) belongs to none. So the first layer counts as the middle ones do.
                by = created.get(key, "stack")
                saver = where[0] if where[0] is not None else ("final" if done[0] else "stack")
                tag = (by, saver[1] if isinstance(saver, tuple) and saver[0] == by else "other") \
                    if isinstance(by, int) else by
                owner[key] = (tag, st.nbytes())
                keep.append(t)
            # what autograd stores in place of the tensor: nothing (the trace never runs backward). A saved output
            # would tie its node to itself in a cycle through C++ that Python's collector cannot see
            return None

        hooks = []
        calls = [[0, 0] for _ in layers]  # each layer's calls a forward: all, and those with gradients (saved)

        rows = [0.0 for _ in layers]  # each layer's input: its positions a row, its bytes (stacks of own widths)
        in_bytes = [0.0 for _ in layers]

        def called(i: int, a: Any = ()) -> None:
            where[0] = (i, "other")
            calls[i][0] += 1
            calls[i][1] += torch.is_grad_enabled()
            if a and isinstance(a[0], torch.Tensor):
                rows[i], in_bytes[i] = a[0].shape[1], a[0].numel() * a[0].element_size()

        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: called(i, a)))
            hooks.append(layer.register_forward_hook(_after_layer(where, done, i, n)))
            for child_name, child in layer.named_children():
                hooks.append(child.register_forward_pre_hook(
                    lambda m, a, i=i, c=child_name: where.__setitem__(0, (i, c))))
                hooks.append(child.register_forward_hook(
                    lambda m, a, o, i=i: where.__setitem__(0, (i, "other"))))
        shares: dict[str, float] = {}
        if widths:
            hooks += _beside_layers(base, named_stacks, where, shares, seq)
        sigs = [tuple((name, p.numel()) for name, p in layer.named_parameters()) for layer in layers]
        weights = _kind_weights(sigs, kinds)
        seen_linears: list[tuple[str, int, int]] = []
        if linears:  # on a layer of the most common kind (the one ModelShape.linears lists)
            common = max(weights, key=weights.__getitem__)
            mid = layers[next((i for i in range(n // 2, n) if sigs[i] == common), sigs.index(common))]
            for name, mod in mid.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    hooks.append(mod.register_forward_pre_hook(
                        lambda m, a, name=name: _note_input(seen_linears, keep, name, m, a[0])))
        if ids:  # the stack embeds token ids itself: its embedding's output is made a leaf, as inputs_embeds is
            tokens = torch.randint(1, int(cfg.vocab_size), (1, seq))
            _embed_as_leaf(base, keep, in_place=widths)
        else:
            embeds = (torch.randn if real else torch.empty)(1, seq, _embedding_width(base, cfg), dtype=torch.bfloat16,
                                                            requires_grad=True)
            keep.append(embeds)  # the embedding's output: the stack's, kept where a layer's norm saves it (Liger's)
        with _flash_like_sdpa(), _liger_rope(layers) if liger else contextlib.nullcontext(), \
                _creators(created, where, done, keep, compute), _grads_forced(layers) if grads else contextlib.nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            given = {"attention_mask": torch.ones(1, seq, dtype=torch.long)} if mask else {}
            # a copy that is not a leaf: some families scale their embeddings in place (CTRL)
            given |= {"input_ids": tokens} if ids else {"inputs_embeds": embeds.clone()}
            if widths and "patch_size" in vars(cfg):
                # patches given (patch_bytes): its patcher picks lengths from its entropies, values fake tensors do not
                # have; its global stack then runs over seq / patch_bytes positions
                size = patch_bytes(cfg)
                given["patch_lengths"] = torch.full((1, seq // size), size, dtype=torch.long)
            base(use_cache=False, **given)
        for h in hooks:
            h.remove()
        # the graph holds this hook (pack) and the hook holds `keep`, whose tensors hold the graph: a cycle through C++
        # that Python's collector cannot free. On real tensors every trace kept its copy's memory (2.3 GB a trace of
        # Qwen4-Exp's, until the process was killed): emptied here, the graph goes with the tensors
        keep.clear()
    if real:
        _return_freed_memory()
    per_layer = [0 for _ in range(n)]
    parts: list[dict[str, int]] = [{} for _ in range(n)]
    final = 0
    for tag, nbytes in owner.values():
        if isinstance(tag, tuple):
            per_layer[tag[0]] += nbytes
            parts[tag[0]][tag[1]] = parts[tag[0]].get(tag[1], 0) + nbytes
        else:  # the final norm's and the stack's own (the embedding output, rotary tables): counted once, at the top
            final += nbytes
    # each kind's mean over its layers in the copy, weighted by its share of the full model's layers. The last layer
    # stands apart where its output is saved by nothing (OLMo 2's next layer saves it, its final norm an fp32 copy):
    # one layer in the full model, so it is left out of a kind that has others. Stacked layers: each stack's last
    # (HRM's stacks end in their own norm), so each stack keeps its share of the mean.
    ends = {n - 1} if len(stack_sizes) == 1 else {sum(stack_sizes[:k + 1]) - 1 for k in range(len(stack_sizes))}
    layer, by_part = 0.0, {}
    for sig, weight in weights.items():
        # a kind only at a stack's end (BLT's one-layer local encoder): that layer
        idx = [i for i in range(n) if i not in ends and sigs[i] == sig] or (
            [i for i in range(n) if sigs[i] == sig] if widths else [n - 1])
        layer += weight * sum(per_layer[i] for i in idx) / len(idx)
        for i in idx:
            for child, nbytes in parts[i].items():
                by_part[child] = by_part.get(child, 0.0) + weight * nbytes / len(idx)
    middle = [i for i in range(n) if i not in ends] or [n - 1]
    r: dict[str, Any] = {"layer": layer / seq, "parts": {k: v / seq for k, v in by_part.items()}, "final": final / seq,
                         "largest_part": max(max(parts[i].values(), default=0) for i in middle) / seq,
                         "calls": [sum(c[0] for c in calls) / n, sum(c[1] for c in calls) / n]}
    if widths:
        # each stack: its layers' positions over the row's tokens (BLT's global stack: one a patch), its inputs' bytes
        # a token (what checkpointing keeps of a layer), what one of its layers saves a token (its middle layers'),
        # and of that what the modules beside the layer save (BLT's cross-attention: checkpointing does not run them
        # again, so a checkpointed layer keeps them too)
        r["stacks"], r["shares"], first = [], shares, 0
        for size in stack_sizes:
            own = range(first, first + size)
            mid = [i for i in own if i not in ends] or list(own)
            beside = sum(n for i in own for child, n in parts[i].items() if child.startswith(BESIDE))
            r["stacks"].append([sum(rows[i] for i in own) / size / seq, sum(in_bytes[i] for i in own) / size / seq,
                                sum(per_layer[i] for i in mid) / len(mid) / seq, beside / size / seq])
            first += size
    if linears:
        groups: dict[int, int] = {}
        r["linears"] = [[name, fin, groups.setdefault(key, len(groups)), key in owner]
                        for name, fin, key in seen_linears]
    return r


@contextlib.contextmanager
def _grads_forced(layers: list[Any]) -> Iterator[None]:
    """Every layer call run with gradients, its own `torch.no_grad()` blocks too: what a reversible layer saves when
    its backward runs it again (Reformer's backward_pass: its attention and feed-forward under enable_grad)."""
    import torch

    def with_grads(forward: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.enable_grad():
                return forward(*args, **kwargs)
        return run

    class KeepGrads(torch.no_grad):  # a no_grad that changes nothing, as a block or a decorator
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: Any) -> None:
            pass

    no_grad = torch.no_grad
    own = [vars(layer).get("forward") for layer in layers]  # a forward set on the instance, put back after
    try:
        torch.no_grad = KeepGrads  # the layers' own blocks
        for layer in layers:
            layer.forward = with_grads(layer.forward)
        yield
    finally:
        torch.no_grad = no_grad
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                vars(layer).pop("forward", None)
            else:
                layer.forward = forward


def _at_length(cfg: Any, seq: int) -> Any:
    """A config whose positions are axial (Reformer: in training its rows must be their product) takes two factors of
    the traced length: they shape the position embedding alone, not what a layer keeps a token."""
    shape = getattr(cfg, "axial_pos_shape", None)
    if isinstance(shape, (list, tuple)) and len(shape) == 2 and math.prod(shape) != seq:
        cfg.axial_pos_shape = type(shape)((seq // AXIAL_SIDE, AXIAL_SIDE))
    return cfg


AXIAL_SIDE = 16


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's malloc_trim). A real trace's tensors, freed, stay in the
    process's heap, and the next copy's allocations do not all reuse them: LongCat-Flash's 12 traces grew to 23 GB of
    RSS with 3.7 GB alive at a time. Elsewhere than glibc: nothing to do."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def _never_unpacked(_: None) -> Any:
    raise TraceError("a saved tensor was read back during the traced forward (the trace stores none)")


def _training_config(cfg: Any) -> Any:
    """The copy as a training run configures it: a family that selects its kernels by a mode (xLSTM's "inference",
    its default, whose fp32 states a bf16 model cannot run) is traced in its training mode."""
    if getattr(cfg, "mode", None) == "inference" and hasattr(cfg, "inference_state_dtype"):
        cfg.mode = "train"
    return cfg


def _bf16_params(model: Any) -> None:
    """Every floating parameter in bf16, the buffers as built: what DeepSpeed's bf16 makes of the module
    (engine._cast_module_mixed_precision). A family that makes a parameter in fp32 whatever dtype it is built in
    (XLNet's torch.FloatTensor, DeepSeek-V4's hyper-connections' .to(float32)) runs it in bf16; tied ones stay tied."""
    import torch

    done: dict[int, tuple[Any, Any]] = {}
    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == torch.bfloat16:
                continue
            if id(p) not in done:
                with torch.no_grad():
                    done[id(p)] = (p, torch.nn.Parameter(p.to(torch.bfloat16), requires_grad=p.requires_grad))
            mod._parameters[key] = done[id(p)][1]


@contextlib.contextmanager
def _fake_conversion() -> Iterator[None]:
    """A module that converts its own parameters while it is built (DeepSeek-V4's and HY-V4's hyper-connections:
    .to(float32)) cannot on fake tensors: torch swaps a fake parameter in place, which the weak reference the fake
    mode holds to it refuses. Such a parameter is replaced by a new one instead, as torch does for plain tensors under
    overwrite_module_params_on_conversion."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    orig = torch.nn.Module._apply

    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        if recurse:
            for child in self.children():
                child._apply(fn)
        if not any(isinstance(p, FakeTensor) for p in self._parameters.values()):
            return orig(self, fn, recurse=False)
        for key, p in list(self._parameters.items()):
            if p is not None:
                with torch.no_grad():
                    new = fn(p)
                if new is not p:
                    self._parameters[key] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
        for key, b in list(self._buffers.items()):
            if b is not None:
                self._buffers[key] = fn(b)
        return self

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = orig


def _embed_as_leaf(base: Any, keep: list, in_place: bool = False) -> None:
    """The input embedding run without autograd and its output made a leaf that needs a gradient: what the layers see
    is what they see from inputs_embeds (nothing of the embedding is counted, as with inputs_embeds). in_place: a
    copy of the leaf, which the stack may add to in place (BLT adds its hash embeddings), as a leaf refuses."""
    import torch

    emb = base.get_input_embeddings()
    plain = emb.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            out = plain(*args, **kwargs)
        keep.append(out)
        return out.requires_grad_().clone() if in_place else out.requires_grad_()
    emb.forward = forward


def _beside_layers(base: Any, stacks: list[tuple[str, Any]], where: list, shares: dict[str, float],
                   seq: int) -> list[Any]:
    """Hooks for a model of stacks of their own widths (BLT). A module list beside a stack in the same module (BLT's
    cross-attention modules) runs with its layers: its k-th module with the k-th layer where the lists are as long,
    else each with the stack's last layer (BLT's local encoder: one after its last layer); what it saves is that
    layer's, so it is counted at each layer of the full model, not once as the stack's own. And every Linear and
    Embedding outside the layers notes its share (name with its indices as *): the rows it runs a forward over the
    row's tokens (BLT's cross-attention keys and values, one a patch), 0 for an embedding other than the input one
    (a lookup: no matmul; BLT's hash embeddings)."""
    import re

    import torch

    hooks = []
    layers = [layer for _, stack in stacks for layer in stack]
    index = {id(layer): i for i, layer in enumerate(layers)}
    for stack_name, stack in stacks:
        parent = base.get_submodule(stack_name.rpartition(".")[0])
        for child_name, other in parent.named_children():
            if other is stack or not isinstance(other, torch.nn.ModuleList):
                continue
            for k, mod in enumerate(other):
                i = index[id(stack[k] if len(other) == len(stack) else stack[-1])]
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, i=i, c=f"{BESIDE}{child_name}": where.__setitem__(0, (i, c))))
                hooks.append(mod.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))
    inside = {id(m) for layer in layers for m in layer.modules()}
    embed = base.get_input_embeddings()

    def note(key: str, mod: Any, a: Any) -> None:
        x = a[0] if a else None
        if isinstance(mod, torch.nn.Linear) and isinstance(x, torch.Tensor):
            shares[key] = x.numel() / mod.in_features / seq
        elif isinstance(mod, torch.nn.Embedding):
            shares[key] = 0.0
    for name, mod in base.named_modules():
        if id(mod) in inside or mod is embed or not isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        hooks.append(mod.register_forward_pre_hook(lambda m, a, key=key: note(key, m, a)))
    return hooks


@contextlib.contextmanager
def _creators(created: dict[int, int | str], where: list, done: list, keep: list,
              compute: bool = True) -> Iterator[None]:
    """Note which layer's code made each storage: every op's outputs, as they come (a dispatch mode over the fake
    tensors). compute=False: a matmul is not run; it returns an empty tensor of its output's shape and strides (read
    on the meta device), so the weights are never read (what autograd saves is the same: it sits above this mode)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    skipped = set() if compute else {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                                     torch.ops.aten.baddbmm.default, torch.ops.aten._grouped_mm.default,
                                     torch.ops.aten.convolution.default}

    class Creators(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = _unrun(func, args, kwargs or {}) if func in skipped else func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    key = t.untyped_storage()._cdata
                    if key not in created:
                        created[key] = where[0][0] if where[0] is not None else ("final" if done[0] else "stack")
                        keep.append(t)  # alive to the end, so no later storage takes its address
            return out

    with Creators():
        yield


def _unrun(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """An op's outputs, empty, of the shapes and strides it gives on the meta device: the op is not run. (The matmuls
    a copy's weights enter; the matrix-vector and out= forms are not among them: no family's layers were seen to
    call them.)"""
    import torch
    from torch.utils._pytree import tree_map

    def on_meta(x: Any) -> Any:
        return x.new_empty_strided(x.size(), x.stride(), device="meta") if isinstance(x, torch.Tensor) else x

    def empty(x: Any) -> Any:
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    return tree_map(empty, func(*tree_map(on_meta, args), **tree_map(on_meta, kwargs)))


def _kind_weights(sigs: list[Any], kinds: list[Any] | None) -> dict[Any, float]:
    """Each layer kind (its parameter list) and its share of the full model's layers; without `kinds`, of the copy's.
    In the order the kinds first appear: a set's order follows the strings' hashes, which change between processes,
    and so did the kind a tie picks (Reformer's local and LSH layers, six each) and the sums' last bits."""
    if not kinds:
        return {k: sigs.count(k) / len(sigs) for k in dict.fromkeys(sigs)}
    missing = set(kinds) - set(sigs)
    if missing:
        raise TraceError(f"{len(missing)} of the model's layer kinds did not appear in its {len(sigs)}-layer copy")
    return {k: kinds.count(k) / len(kinds) for k in dict.fromkeys(kinds)}


def _note_input(seen: list, keep: list, name: str, mod: Any, x: Any) -> None:
    keep.append(x)  # alive to the end, so no later storage takes its address (the key)
    seen.append((name, mod.in_features, x.untyped_storage()._cdata))


def _after_layer(where: list, done: list, i: int, n: int):
    def hook(m: Any, a: Any, o: Any) -> None:
        where[0] = None
        if i == n - 1:
            done[0] = True
    return hook


def _embedding_width(base: Any, cfg: Any) -> int:
    """The width of what the stack takes as inputs_embeds: the input embedding's, which is narrower than the hidden
    size where a projection follows it (ELECTRA's, RemBERT's embedding_size)."""
    import torch

    try:
        emb = base.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a stack that does not say (TrOCR's decoder)
        emb = None
    return int(emb.embedding_dim) if isinstance(emb, torch.nn.Embedding) else _hidden(cfg)


def _hidden(cfg: Any) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise TraceError("the config has no hidden size")


def _decoder_layers(base: Any, n: int, stacked: bool = False) -> list[Any]:
    """The copy's n decoder layers; stacked (per_stack): every list of n, in the model's order (HRM's two stacks)."""
    import torch

    if stacked:  # every list of n not inside another (a layer's own list of n experts is not a stack)
        found = [(name, mod) for name, mod in base.named_modules() if isinstance(mod, torch.nn.ModuleList) and len(mod) == n]
        stacks = [mod for name, mod in found if not any(name.startswith(f"{other}.") for other, _ in found)]
        if stacks:
            return [layer for stack in stacks for layer in stack]
    for _, mod in base.named_children():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return list(mod)
    for _, mod in base.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return list(mod)
    raise TraceError(f"no list of {n} decoder layers in {type(base).__name__}")


@contextlib.contextmanager
def _no_packed_mask() -> Iterator[None]:
    """transformers' `is_tracing` is true for fake tensors, so it looks for packed sequences and builds a 4-D mask:
    an unpacked batch on a GPU has none (the note's pitfall 1: +9.4% on llama-1b)."""
    import transformers.masking_utils as mu

    old = getattr(mu, "find_packed_sequence_indices", None)
    if old is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = old


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings about the config, and fake-tensor's traceback of an op that fails (the trace says why
    in one line)."""
    import logging as std

    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    fake = std.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake.level
    fake.setLevel(std.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        fake.setLevel(fake_level)


FLASH_LIKE = "toolkit_trace_fused"  # a name with "flash" in it would send transformers to its flash checks


def _flash_like_fn() -> Any:
    """An autograd.Function saving what CUDA's fused attention kernels save: q, k, v, the output and an fp32
    log-sum-exp per query and head (dropout stays inside those kernels: an rng state, not a mask)."""
    import torch

    class FlashLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, out: Any) -> Any:
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # never run: the trace is forward only
            raise NotImplementedError

    return FlashLike


def _register_flash_like() -> None:
    import torch
    from transformers import AttentionInterface

    fn = _flash_like_fn()

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        # (batch, heads, seq, head dim) in; (batch, seq, heads, value dim) out, as transformers' sdpa returns it
        b, h, s, _ = query.shape
        out = torch.empty(b, s, h, value.shape[-1], dtype=query.dtype, device=query.device)
        return fn.apply(query, key, value, out), None

    AttentionInterface.register(FLASH_LIKE, attention)


@contextlib.contextmanager
def _flash_like_sdpa() -> Iterator[None]:
    """`scaled_dot_product_attention` saving what CUDA's fused kernels save, whatever path the CPU would take."""
    import torch
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention
    fn = _flash_like_fn()

    def sdpa(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        kwargs.update(zip(names, args, strict=False))
        kwargs["dropout_p"] = 0.0
        with torch.no_grad():
            out = orig(q, k, v, **kwargs)
        return fn.apply(q, k, v, out)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


@contextlib.contextmanager
def _liger_rope(layers: list[Any]) -> Iterator[None]:
    """The layers' module-level `apply_rotary_pos_emb` as Liger replaces it (liger_rotary_pos_emb): q and k come back
    in (batch, seq, heads, head dim) memory, and only cos and sin are saved. The attention output takes q's layout, so
    where transformers' own RoPE returns q in (batch, heads, seq, head dim) memory (Phi-3's partial-rotary cat) the
    output is copied for o_proj and the trace counted that copy, which a Liger run does not make: 6,144 bytes a token
    a layer of Phi-3-mini (bench/results/speed_model/families/phi3_anatomy.json: what was alive at a GPU run's
    peak)."""
    import inspect
    import sys

    import torch

    class RopeLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, *tables: Any) -> Any:
            ctx.save_for_backward(*tables)
            # new storages in (batch, seq, heads, dim) memory, as Liger's in-place kernel leaves its contiguous copies
            return tuple(torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)
                         for t in (q, k))

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:  # never run: the trace is forward only
            raise NotImplementedError

    def like_liger(own: Any) -> Any:
        def rope(q: Any, k: Any = None, *args: Any, **kwargs: Any) -> Any:  # (q, k, cos, sin, ...): Liger saves cos, sin
            if k is None:  # a call rotating q alone (Qwen4-Exp's indexer), which Liger's function does not take
                return own(q, *args, **kwargs)
            return RopeLike.apply(q, k, *[t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)][:2])
        return rope

    def liger_form(fn: Any) -> bool:  # Liger's takes (q, k, cos, sin, ...); a family rotating one tensor a call keeps its own
        try:
            return list(inspect.signature(fn).parameters)[:2] == ["q", "k"]
        except (TypeError, ValueError):
            return False

    modules = {sys.modules[type(layer).__module__] for layer in layers}
    saved = {m: m.apply_rotary_pos_emb for m in modules if liger_form(getattr(m, "apply_rotary_pos_emb", None))}
    for m, own in saved.items():
        m.apply_rotary_pos_emb = like_liger(own)
    try:
        yield
    finally:
        for m, fn in saved.items():
            m.apply_rotary_pos_emb = fn


def _liger_like(base: Any) -> None:
    """Swap the RMSNorms and gated MLPs for modules that save what Liger's kernels save."""
    import torch

    class RMSNormLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, like: Any) -> Any:
            rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(x, rstd)
            return like(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            raise NotImplementedError

    class GatedLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            ctx.save_for_backward(a, b)
            return a * b  # the value's exact form does not matter to what is saved

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            raise NotImplementedError

    def norm_forward(mod: Any) -> Any:
        plain = mod.forward

        def forward(x: Any, *rest: Any, **kw: Any) -> Any:
            if rest or kw:  # a gated norm (Mamba-style): not one of Liger's
                return plain(x, *rest, **kw)
            with torch.no_grad():
                shape = plain(x).shape
            if shape != x.shape:  # not a norm of its input (HY-V4's unweighted one returns the rstd): not Liger's
                return plain(x)
            return RMSNormLike.apply(x, lambda y: torch.empty_like(y))
        return forward

    def mlp_forward(mod: Any) -> Any:
        plain = mod.forward

        def forward(x: Any, *rest: Any, **kw: Any) -> Any:
            if rest or kw:  # an MLP that takes more than its input (Zamba 2's per-layer adapters): not one of Liger's
                return plain(x, *rest, **kw)
            if hasattr(mod, "gate_up_proj"):
                a, b = mod.gate_up_proj(x).chunk(2, dim=-1)
            else:
                a, b = mod.gate_proj(x), mod.up_proj(x)
            return mod.down_proj(GatedLike.apply(a, b))
        return forward

    for _, mod in base.named_modules():
        if "RMSNorm" in type(mod).__name__:
            mod.forward = norm_forward(mod)
        elif isinstance(getattr(mod, "down_proj", None), torch.nn.Linear) and (
                hasattr(mod, "gate_up_proj") or hasattr(mod, "gate_proj")):
            mod.forward = mlp_forward(mod)
