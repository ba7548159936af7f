"""A model's shape, read on the meta device: every parameter's size in order, no weights, no GPU.

`toolkit plan` needs the parameter list (ZeRO-3 sub-groups, persistent parameters, the largest
gathered layer, LoRA targets) and the dimensions the activation formulas use. Building the model on
the meta device is the truth for any Hugging Face causal LM, but importing transformers' modelling
code costs about 5 s on the development machine, far above the 2 s `plan` may take. So:

- presets: the meta-device read of every causal-LM preset is committed in `model_shapes.json`, with a
  fingerprint of the preset's config; `tests/unit/test_planner.py` reads them on the meta device
  again and asserts the file is current (as ds_configs/ is kept equal to `gen-config --all`);
- local directories: read on the meta device once, then cached under $TOOLKIT_CACHE (default
  ~/.cache/ds-toolkit/shapes), keyed by the config.json bytes and the transformers version.

Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError

SHAPES_FILE = Path(__file__).with_name("model_shapes.json")
SHAPE_VERSION = 11  # bump when ModelShape or what plans changes: cached and committed shapes are then read again


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, in parameter order (the order DeepSpeed sees)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    max_positions: int | None
    prefix_params: tuple[tuple[str, int], ...]
    """(name, numel) of the parameters before the first decoder layer (the input embedding)."""
    layer_params: tuple[tuple[str, int], ...]
    """(name inside the layer, numel) of one decoder layer: the most common kind where the layers differ."""
    suffix_params: tuple[tuple[str, int], ...]
    """(name, numel) after the last layer: the final norm, and the LM head when it is not tied."""
    linears: tuple[tuple[str, int, int], ...]
    """One decoder layer's nn.Linear modules (and GPT-2's Conv1D): (name inside the layer, in_features, out_features)."""
    task: str = "causal_lm"
    """causal_lm (a vocabulary-sized head and loss) or seq_cls (BERT: a classifier on one token)."""
    num_experts: int = 0
    """Mixture-of-Experts: experts per layer (0: a dense model)."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    """One expert's intermediate size (Qwen-MoE's moe_intermediate_size; Mixtral's and OLMoE's intermediate_size)."""
    trace: dict[str, Any] | None = None
    """What a decoder layer saves for backward, traced from the model's own code (toolkit/plan/trace.py); None for
    the families with a counted formula (FORMULA_TYPES) and where the trace failed (trace_error says why)."""
    trace_error: str = ""
    other_layers: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    """The decoder layers whose parameters differ from layer_params, (index, their list): DeepSeek-V3's dense first
    layers among its MoE layers, a hybrid's attention layers among its recurrent ones. Parameter counts (ZeRO's
    groups, totals, the largest layer) read every layer; the trace's bytes are the mean over them; what is read per
    Linear (LoRA's targets, FLOPs, float8) reads the most common kind."""

    sliding_window: int = 0
    """Keys a query of a sliding-window layer attends at most, where the varlen kernel takes the window (Gemma 3,
    Mistral; config/attention.kernel_window); 0: none."""
    sliding_layers: int = 0
    """How many decoder layers attend through that window (Gemma 3: five in six; Mistral: all)."""
    layer_heads: tuple[tuple[int, int, bool], ...] = ()
    """Where a config sets head counts or head dims per layer (transformers' per_layer_config; Gemma 4: head dim 512 in
    its full-attention layers, 256 in its sliding ones): each layer's (query heads, head dim, attends through the
    window); the attention term reads these. Empty where every layer has num_heads x head_dim; where set, num_heads,
    num_kv_heads and head_dim are the config's base values, which most of its layers take."""

    sdpa: bool = True
    """transformers runs the causal LM's attention through sdpa (its class's _supports_sdpa; an encoder: True). False
    (Gemma 2's softcapping, gpt-oss's sinks, a family's own attention: MPT, Reformer): a run asked for sdpa takes eager
    (runtime/attention.plan, config/attention.has_sdpa), and the plan counts eager attention's bytes
    (planner.run_attention)."""
    checkpointing: bool = True
    """transformers can checkpoint the model's layers (supports_gradient_checkpointing; not Reformer's, reversible):
    where not, the plan takes no checkpointing choice."""
    train_seq: int = 0
    """The one row length the model trains at (Reformer: the product of its axial positions, the only length its
    training forward takes); 0: any up to max_positions."""
    frozen_params: int = 0
    """Parameters the model builds with requires_grad=False (BLT's entropy patcher, run in every forward without
    gradients): held as bf16 weights, no gradients or optimizer states (planner.trainable_params), forward FLOPs only."""
    token_params: float = 0.0
    """Where the model's parts run at other counts than one a token (BLT: its global stack once a patch, its
    cross-attention keys and values once a patch, its hash embeddings looked up): the trained parameters a token runs
    through in matmuls, each at its share of the row's tokens (the trace's); 0: active_params, as for every other."""
    token_layer_params: float = 0.0
    """Of token_params, the decoder layers' (what checkpointing runs again)."""

    @property
    def mean_head_dim(self) -> int:
        """head_dim, or where the config sets it per layer (layer_heads) the mean over the layers, rounded up: a KV
        cache of num_layers x num_kv_heads x this holds every layer's."""
        if not self.layer_heads:
            return self.head_dim
        return -(-sum(d for _, d, _ in self.layer_heads) // len(self.layer_heads))

    def layers(self) -> Iterator[tuple[tuple[str, int], ...]]:
        """Every decoder layer's parameter list, in order."""
        other = dict(self.other_layers)
        for i in range(self.num_layers):
            yield other.get(i, self.layer_params)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the experts it is not routed to (each layer's `experts`
        parameters, an equal share each)."""
        if not self.num_experts:
            return self.total_params
        experts = sum(n for layer in self.layers() for name, n in layer if ".experts." in f".{name}")
        return self.total_params - experts * (self.num_experts - self.experts_per_token) // self.num_experts

    @property
    def layer_owners(self) -> set[str]:
        """The modules that hold one decoder layer's parameters, by name inside the layer (a Linear's weight and bias
        are one): what ZeRO-3's hooks run for, and what a leaf layer's host time a call grows with beyond one rank."""
        return {name.rsplit(".", 1)[0] for name, _ in self.layer_params}

    @property
    def layer_modules(self) -> int:
        return len(self.layer_owners)

    @property
    def layer_numel(self) -> int:
        """One decoder layer's parameters: the mean over the layers where they differ."""
        return self.layers_numel // self.num_layers

    @property
    def layers_numel(self) -> int:
        return sum(n for layer in self.layers() for _, n in layer)

    @property
    def largest_layer_numel(self) -> int:
        return max(sum(n for _, n in layer) for layer in self.layers())

    @property
    def total_params(self) -> int:
        return (sum(n for _, n in self.prefix_params) + self.layers_numel + sum(n for _, n in self.suffix_params))

    def without_experts(self) -> ModelShape:
        """The shape less its experts' parameters (AutoEP keeps them on their ranks: nothing of them is gathered)."""
        def strip(layer: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
            return tuple(x for x in layer if ".experts." not in f".{x[0]}")
        return replace(self, layer_params=strip(self.layer_params),
                       other_layers=tuple((i, strip(layer)) for i, layer in self.other_layers))

    @property
    def embed_numel(self) -> int:
        return self.vocab_size * self.hidden_size

    def param_numels(self) -> Iterator[int]:
        """Every unique parameter's numel, in `model.parameters()` order."""
        yield from (n for _, n in self.prefix_params)
        for layer in self.layers():
            yield from (n for _, n in layer)
        yield from (n for _, n in self.suffix_params)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        d = dict(data)
        for key in ("prefix_params", "layer_params", "suffix_params", "linears"):
            d[key] = tuple(tuple(x) for x in d[key])
        d["other_layers"] = tuple((int(i), tuple(tuple(x) for x in layer)) for i, layer in d.get("other_layers", ()))
        d["layer_heads"] = tuple((int(h), int(dim), bool(win)) for h, dim, win in d.get("layer_heads", ()))
        return cls(**d)


# -- reading on the meta device (torch + transformers inside) ---------------------------------------

_LAYER = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")


def task_of(model_type: str) -> str:
    """The task the toolkit trains a model type on: encoders (BERT) classify, everything else is a causal LM."""
    return "seq_cls" if model_type in ENCODERS else "causal_lm"


ENCODERS = frozenset({"bert"})
# Families whose activations stay a counted formula (planner._layernorm_layer_bytes): GPT-2 and BERT, LayerNorm blocks
# with dropout, each checked against GPU peaks; the trace would also run their dropout on the CPU's math attention.
FORMULA_TYPES = frozenset({"gpt2", "bert"})


# what a config may set per layer (transformers' per_layer_config) and still plan: the attention term reads each
# layer's heads (ModelShape.layer_heads), and MLA's query-key width from its qk_nope_head_dim (dots3); the parameters,
# the trace and the FLOPs are read from the layers themselves (all that MLA's kv_lora_rank changes)
PER_LAYER_READ = frozenset({"head_dim", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
                            "qk_nope_head_dim"})


def read_shape(mc: Any, *, trace: bool = True) -> ModelShape:
    """Build the model described by the HF config `mc` on the meta device and read its parameters: a causal LM,
    or for an encoder (BERT) the sequence classifier the toolkit trains (model.task=seq_cls)."""
    varying = set(getattr(mc, "per_layer_attributes", None) or ())
    if varying - PER_LAYER_READ:
        raise ConfigError(f"{mc.model_type!r} sets {', '.join(sorted(varying - PER_LAYER_READ))} per layer "
                          f"(per_layer_config): toolkit plan reads only {', '.join(sorted(PER_LAYER_READ))} per layer")
    if not varying:
        return _read_shape(mc, trace=trace)
    # a global read of a per-layer attribute is refused (AmbiguousGlobalPerLayerAttributeError): the base values are
    # read as the config's own, and each layer's from its layer config (_layer_heads)
    from toolkit.plan.trace import quiet_transformers

    allowed = mc.allow_global_per_layer_attribute_access
    mc.allow_global_per_layer_attribute_access = True
    try:
        with quiet_transformers():  # its warning at each such read: this one reads them knowingly
            return _read_shape(mc, trace=trace)
    finally:
        mc.allow_global_per_layer_attribute_access = allowed


def family_defaults(model_type: str, max_layers: int = 8) -> Any:
    """A family's config at transformers' defaults with at most `max_layers` decoder layers, as a checkpoint's
    config.json would hold it: fields that a few families leave null, and whose own code then fails, are set the way
    every other family derives them (Ministral's and Hunyuan's head_dim: hidden / heads; Nemotron's key-value heads:
    one a query head; an MoE's routing, MOE_FILLS, and its expert width; DBRX's attention, DBRX_ATTN_FILLS;
    X-MOD's language). What the sweep of every causal LM family plans
    (tests/unit/test_trace.py, bench/plan_families.py); raises what the family's own validation raises."""
    from transformers import CONFIG_MAPPING

    from toolkit.plan.trace import small_config, stack_configs, sublayers

    cfg = CONFIG_MAPPING[model_type]()
    # stacks of their own widths and counts (BLT), which the config does not count as one: each cut on its own
    if any(int(getattr(cfg, k).num_hidden_layers) > max_layers for k in stack_configs(cfg)):
        cfg = small_config(cfg, max_layers)
    with contextlib.suppress(Exception):  # encoder-decoders count their layers otherwise
        # a few layers: a layout of unlike layers shows (DeepSeek-V3's 3 dense first, Jamba's 1 attention in 8); the
        # per-layer lists are cut alike (Zamba's block types), as the trace cuts its copy
        if int(cfg.num_hidden_layers) // sublayers(cfg) > max_layers:
            cfg = small_config(cfg, max_layers)
    # per-layer configs refuse a global read or write (read_shape says so in one line): left as they are
    with contextlib.suppress(Exception):
        heads = cfg.num_attention_heads
        if isinstance(heads, int) and heads > 0:
            if "head_dim" in vars(cfg) and cfg.head_dim is None:
                cfg.head_dim = int(cfg.hidden_size) // heads
            if "num_key_value_heads" in vars(cfg) and cfg.num_key_value_heads is None:
                cfg.num_key_value_heads = heads
    # an MoE whose defaults leave its routing null (DeepSeek-V2, dots1: every checkpoint sets it): 8 routed experts,
    # top-2 (Mixtral's), one shared expert, no expert groups
    for name, value in MOE_FILLS.items():
        if name in vars(cfg) and getattr(cfg, name) is None:
            setattr(cfg, name, value)
    # an expert width torch's grouped matmul refuses (16-byte strides: DeepSeek-V2's default 1,407) is rounded up to a
    # multiple of 8, as every checkpoint's is (DeepSeek-V2-Lite's config.json: 1,408)
    width = getattr(cfg, "moe_intermediate_size", None)
    if isinstance(width, int) and width % 8:
        cfg.moe_intermediate_size = -(-width // 8) * 8
    # DBRX: its attention config's defaults lack the rope_theta its code reads, and a null clip_qkv makes its forward
    # call clamp() with neither bound; DBRX's config.json sets both
    attn = getattr(cfg, "attn_config", None)
    if cfg.model_type == "dbrx" and attn is not None:
        for name, value in DBRX_ATTN_FILLS.items():
            if getattr(attn, name, None) is None:
                setattr(attn, name, value)
    # Reformer's causal LM refuses a config that is not a decoder, which its causal checkpoints set
    # (google/reformer-crime-and-punishment's config.json: is_decoder true)
    if cfg.model_type == "reformer":
        cfg.is_decoder = True
    # X-MOD runs one language's adapters a forward and refuses to run without one (set_default_language): its first
    if getattr(cfg, "languages", None) and getattr(cfg, "default_language", "") is None:
        cfg.default_language = cfg.languages[0]
    # North's text model (cohere_compass_text) sets RoPE per layer type, and its defaults leave it empty, which its
    # rotary embedding cannot build from: North-Micro-Vision-Instruct's text config, M-RoPE on its sliding layers and
    # no positions on its full ones (NoPE)
    if cfg.model_type == "cohere_compass_text" and not cfg.rope_parameters:
        cfg.rope_parameters = copy.deepcopy(COMPASS_ROPE)
    # LFM2-MoE's defaults leave its conv / attention layout null, which its layers index: LFM2-8B-A1B's, cut to the
    # layer count as the trace cuts a per-layer list
    if cfg.model_type == "lfm2_moe" and cfg.layer_types is None:
        cfg.layer_types = [LFM2_MOE_LAYER_TYPES[i % len(LFM2_MOE_LAYER_TYPES)] for i in range(cfg.num_hidden_layers)]
    # Qwen4-Exp's indexed-attention layers need the QSA indexer its defaults leave null, and its linear attention's
    # output gate: the released Qwen4-Exp config's, with its RoPE on a quarter of each head (which the index head fits)
    if cfg.model_type == "qwen4_exp_text" and all(getattr(cfg, name) is None for name in QWEN4_EXP_FILLS):
        for name, value in QWEN4_EXP_FILLS.items():
            setattr(cfg, name, value)
        cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 0.25}
        cfg.validate_architecture()
    return cfg


MOE_FILLS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1}
DBRX_ATTN_FILLS = {"rope_theta": 500_000.0, "clip_qkv": 8.0}
LFM2_MOE_LAYER_TYPES = ["conv", "conv", "full_attention", *(["conv", "conv", "conv", "full_attention"] * 4), "conv", "conv",
                        "full_attention", "conv", "conv"]
QWEN4_EXP_FILLS = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
                   "indexer_compress_ratio": 4, "output_gate_type": "sigmoid"}
COMPASS_ROPE = {"full_attention": None, "sliding_attention": {"rope_type": "default", "rope_theta": 50_000.0,
                                                              "mrope_section": [24, 20, 20], "mrope_interleaved": True}}


def _read_shape(mc: Any, *, trace: bool = True) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.initialization import no_init_weights

    task = task_of(str(mc.model_type))
    if "text_config" in (getattr(mc, "sub_configs", None) or {}):
        text = getattr(mc.text_config, "model_type", "its text model")
        raise ConfigError(f"{mc.model_type!r} is multimodal: toolkit plan models its language model alone; plan a "
                          f"config of model_type {text!r}")
    auto = AutoModelForSequenceClassification if task == "seq_cls" else AutoModelForCausalLM
    if getattr(mc, "is_encoder_decoder", False):
        raise ConfigError(f"{mc.model_type!r} is an encoder-decoder: toolkit plan models decoder-only causal LMs (and "
                          "BERT)")
    try:
        with torch.device("meta"), no_init_weights():
            model = auto.from_config(mc)
    except ValueError as e:  # neither (T5, ...)
        raise ConfigError(f"toolkit plan needs a causal language model or BERT; {mc.model_type!r} is neither ({e})") from None
    except Exception as e:  # the family's own code refuses this config (a field it needs is unset)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"transformers could not build {mc.model_type!r} from this config ({type(e).__name__}: "
                          f"{first})") from None
    model.tie_weights()  # no_init_weights skips the tying that a real build does (toolkit/runtime/model.py ties too)
    seen: set[int] = set()
    params: list[tuple[str, int]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied: DeepSpeed and model.parameters() see it once
            continue
        seen.add(id(p))
        params.append((name, p.numel()))
    from toolkit.plan.trace import per_stack, stack_configs, sublayers, trained_stacks

    widths = stack_configs(mc)
    named = trained_stacks(model) if widths else []
    if widths and not named:
        raise ConfigError(f"{mc.model_type!r} is built of {len(widths)} layer stacks of their own widths and layer "
                          f"counts ({', '.join(widths)}) and none of them trains: toolkit plan models stacks of "
                          "decoder layers")
    stacked = per_stack(mc)
    if named:
        # stacks of their own widths and counts (BLT): the decoder layers are every trained stack's, in parameter
        # order, of unlike kinds (other_layers); every parameter outside them (cross-attention modules, projections,
        # hash embeddings, the frozen patcher, the head) is the prefix's (before the first layer) or the suffix's: in
        # the suffix, those between the stacks come after the last layer, the one order that differs from DeepSpeed's
        stacks = [name for name, _ in named]
        inside = tuple(f"{stack}." for stack in stacks)
        by_layer = [tuple((n, p.numel()) for n, p in layer.named_parameters()) for _, stack in named for layer in stack]
        layers = len(by_layer)
        first = next(i for i, (n, _) in enumerate(params) if n.startswith(inside))
        outside = [(i, x) for i, x in enumerate(params) if not x[0].startswith(inside)]
        prefix, suffix = [x for i, x in outside if i < first], [x for i, x in outside if i > first]
    else:
        # the decoder layers the model builds: num_hidden_layers of them, or every stack's (HRM: two of 16 a stack)
        layers = stacked or int(_cfg(mc, "num_hidden_layers", "n_layer")) // sublayers(mc)
        stacks, by_layer = _split_layers(params, layers, stacked=stacked is not None)
        layers = len(by_layer)
        first = next(i for i, (n, _) in enumerate(params) if n.startswith(f"{stacks[0]}.0."))
        last = max(i for i, (n, _) in enumerate(params) if _LAYER.match(n) and n.startswith(f"{stacks[-1]}."))
        prefix, suffix = params[:first], params[last + 1:]
    per_layer = Counter(by_layer).most_common(1)[0][0]
    modules = [layer for stack in stacks for layer in model.get_submodule(stack)]
    layer0 = modules[by_layer.index(per_layer)]
    # GPT-2's projections are transformers' Conv1D: a Linear with its weight stored (in, out)
    linears = tuple((n, m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
                    else (n, int(m.weight.shape[0]), int(m.weight.shape[1]))
                    for n, m in layer0.named_modules()
                    if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
    # stacks of their own widths (BLT): the widths of the last stack, the one under the head (_top_config)
    top = _top_config(model, stacks[-1]) if named else mc
    hidden = int(_cfg(top, "hidden_size", "n_embd"))
    # a state-space model (Mamba, RWKV) has no attention heads: no attention term in its FLOPs, nothing per head
    heads = int(_cfg(top, "num_attention_heads", "n_head", default=0))
    # the layer kinds the trace matches its copy's layers against: each layer's own parameters (a layer that shares a
    # block with an earlier one, as Zamba's hybrid layers do, is of that one's kind, though counted once above)
    own = [tuple((n, p.numel()) for n, p in layer.named_parameters()) for layer in modules]
    kinds = own if len(own) == layers and len(set(own)) > 1 else None
    # the kinds whose later layers share their block with the first (their parameters counted there)
    shared = frozenset(own[i] for i in range(layers) if kinds and sum(n for _, n in own[i]) > sum(n for _, n in by_layer[i]))
    traced, trace_error = _traced(mc, task, kinds, shared) if trace else (None, "not traced (parameters only)")
    top_k = int(getattr(mc, "num_experts_per_tok", None) or 0)
    experts = int(getattr(mc, "num_experts", None) or getattr(mc, "num_local_experts", None) or 0) if top_k else 0
    sliding = _sliding(mc, layers)
    # what the model builds frozen (BLT's patcher): no gradients, no optimizer states, forward FLOPs only
    frozen = sum(p.numel() for p in {id(p): p for p in model.parameters() if not p.requires_grad}.values())
    return ModelShape(
        model_type=str(mc.model_type),
        vocab_size=int(mc.vocab_size),
        hidden_size=hidden,
        intermediate_size=_mean_width(_cfg(top, "intermediate_size", "n_inner", default=None) or 4 * hidden),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(getattr(top, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(top, "head_dim", None) or (hidden // heads if heads else 0)),
        tied_embeddings=bool(getattr(mc, "tie_word_embeddings", False)),
        max_positions=_cfg(mc, "max_position_embeddings", "n_positions", default=None),
        prefix_params=tuple(prefix),
        layer_params=per_layer,
        suffix_params=tuple(suffix),
        linears=linears,
        task=task,
        num_experts=experts,
        experts_per_token=top_k,
        expert_intermediate=int(getattr(mc, "moe_intermediate_size", None) or getattr(mc, "intermediate_size", 0))
        if experts else 0,
        trace=traced,
        trace_error=trace_error,
        other_layers=tuple((i, p) for i, p in enumerate(by_layer) if p != per_layer),
        **sliding,
        layer_heads=_stack_heads(model, named) if named else _layer_heads(mc, layers, hidden, windowed=bool(sliding)),
        sdpa=task != "causal_lm" or bool(getattr(type(model), "_supports_sdpa", False)),
        checkpointing=bool(getattr(model, "supports_gradient_checkpointing", True)),
        train_seq=math.prod(mc.axial_pos_shape) if getattr(mc, "axial_pos_embds", False) else 0,
        frozen_params=frozen,
        **(_token_params(model, named, traced) if named and traced else {}),
    )


# Stacks of their own widths (BLT). Where the planner reads one width, it reads the last stack's, under the head: the
# head's input (the loss, the final norm), and the top layer whose backward runs first (its MLP's and attention's
# gradients at the peak of a checkpointed backward); LoRA's targets, float8 and Muon read the most common layer kind's
# Linears (BLT: the global stack's), as for any model of unlike layers. What differs per stack is read per stack: the
# layers' saved bytes and checkpointed inputs a token (the trace's stacks), the attention's heads (layer_heads, timed at
# each stack's share of the row: planner._step_time_s) and the FLOPs (token_params).


def _top_config(model: Any, stack: str) -> Any:
    """The config of the module holding the last stack (BLT's local decoder: the layers under the head)."""
    return model.get_submodule(stack.rpartition(".")[0]).config


def _stack_heads(model: Any, named: list[tuple[str, Any]]) -> tuple[tuple[int, int, bool], ...]:
    """Each layer's (query heads, head dim, windowed) from its stack's config: BLT's global stack at its own width.
    Not windowed: BLT's local window is a mask sdpa computes whole (it has no varlen path)."""
    out = []
    for name, stack in named:
        cfg = _top_config(model, name)
        heads = int(cfg.num_attention_heads)
        dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
        out += [(heads, dim, False)] * len(stack)
    return tuple(out)


def _token_params(model: Any, named: list[tuple[str, Any]], traced: dict[str, Any]) -> dict[str, float]:
    """token_params and token_layer_params: each trained parameter at its share of the row's tokens, as the trace saw
    its module run (trace.py _beside_layers): a layer's at its stack's share (BLT's global stack: 1 / patch_size), a
    module outside the layers at its own (cross-attention keys and values once a patch), 0 for an embedding looked up
    beside the input one (BLT's hash embeddings: no matmul); a module the trace did not run (the head, which the trace
    leaves out) at every token. Frozen parameters are left out (the planner runs them forward only)."""
    prefix = f"{model.base_model_prefix}."
    layer_shares = {name: share for (name, _), (_, share, *_rest) in zip(named, traced["stacks"], strict=True)}
    layers = outside = 0.0
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        if not p.requires_grad:
            continue
        stack = next((s for s in layer_shares if name.startswith(f"{s}.")), None)
        if stack is not None:
            layers += p.numel() * layer_shares[stack]
            continue
        module = re.sub(r"\.\d+(?=\.|$)", ".*", name.rpartition(".")[0].removeprefix(prefix))
        outside += p.numel() * traced["shares"].get(module, 1.0)
    return {"token_params": layers + outside, "token_layer_params": layers}


def _layer_heads(mc: Any, layers: int, hidden: int, *, windowed: bool) -> tuple[tuple[int, int, bool], ...]:
    """Each layer's (query heads, head dim, through the window) where the config sets them per layer, else ()."""
    if not getattr(mc, "per_layer_attributes", None):
        return ()
    from toolkit.config.models import per_layer

    types = getattr(mc, "layer_types", None) or []
    heads = per_layer(mc, "num_attention_heads", layers)
    if "qk_nope_head_dim" in mc.per_layer_attributes:  # MLA: a query meets a key over its nope and rope parts (dots3)
        dims = [int(d) + int(mc.qk_rope_head_dim) for d in per_layer(mc, "qk_nope_head_dim", layers)]
    else:
        dims = per_layer(mc, "head_dim", layers)
    return tuple((int(h), int(d or hidden // h), windowed and i < len(types) and types[i] == "sliding_attention")
                 for i, (h, d) in enumerate(zip(heads, dims, strict=True)))


def _sliding(mc: Any, layers: int) -> dict[str, int]:
    """The window and the count of sliding-window layers the varlen kernel runs at their window
    (config/attention.kernel_window; the others, Gemma 2's and gpt-oss's, are timed as full causal layers)."""
    from toolkit.config.attention import kernel_window, sliding_layers

    window = kernel_window(mc)
    n = sliding_layers(mc, layers) if window else 0
    return {"sliding_window": window, "sliding_layers": n} if window and n else {}


def _traced(mc: Any, task: str, kinds: list[Any] | None, shared: frozenset[Any]) -> tuple[dict[str, Any] | None, str]:
    """The activation trace of a causal LM outside FORMULA_TYPES, or why there is none."""
    if task != "causal_lm" or str(mc.model_type) in FORMULA_TYPES:
        return None, ""
    from toolkit.plan.trace import TraceError, trace_layers

    try:
        return trace_layers(mc, kinds, shared), ""
    except TraceError as e:
        return None, f"its layers could not be traced on fake tensors ({e})"


def _mean_width(value: Any) -> int:
    """A width, or the mean of one given per layer (Gemma 3n's MLP widths: what the layers' FLOPs sum to)."""
    if isinstance(value, (list, tuple)):
        return round(sum(value) / len(value))
    return int(value)


def _cfg(mc: Any, *names: str, default: Any = ...) -> Any:
    for n in names:
        v = getattr(mc, n, None)
        if v is not None:
            return v
    if default is ...:
        raise ConfigError(f"model config has none of {', '.join(names)}")
    return default


def _split_layers(params: list[tuple[str, int]], layers: int,
                  stacked: bool = False) -> tuple[list[str], list[tuple[tuple[str, int], ...]]]:
    """The ModuleList holding `layers` decoder layers (stacked: every list of `layers`, in order), and each layer's
    parameter list."""
    stacks: dict[str, dict[int, list[tuple[str, int]]]] = {}
    for name, n in params:
        m = _LAYER.match(name)
        if m:
            stacks.setdefault(m["stack"], {}).setdefault(int(m["index"]), []).append((m["rest"], n))
    found = [stack for stack, by_index in stacks.items() if sorted(by_index) == list(range(layers))]
    if found:
        found = found if stacked else found[:1]
        return found, [tuple(stacks[stack][i]) for stack in found for i in range(layers)]
    found = ", ".join(f"{stack} ({len(by_index)})" for stack, by_index in stacks.items())
    raise ConfigError(f"cannot find the {layers} decoder layers in the model's parameter names (its layer lists: "
                      f"{found or 'none'})")


# -- where shapes come from -----------------------------------------------------------------------


def preset_fingerprint(name: str) -> str:
    from toolkit.config.models import PRESETS

    return hashlib.sha256(json.dumps(PRESETS[name], sort_keys=True).encode()).hexdigest()[:16]


def committed_shapes() -> dict[str, Any]:
    try:
        return json.loads(SHAPES_FILE.read_text())
    except (OSError, ValueError):
        return {}


def preset_shape(name: str) -> ModelShape:
    """A preset's shape: the committed meta-device read if it is current, else a fresh read."""
    entry = committed_shapes().get(name)
    if entry and entry.get("fingerprint") == preset_fingerprint(name) and entry.get("version") == SHAPE_VERSION:
        return ModelShape.from_json(entry["shape"])
    return read_shape(preset_config(name))


def preset_config(name: str) -> Any:
    from transformers import CONFIG_MAPPING

    from toolkit.config.models import PRESETS, SPECIAL_IDS

    spec = dict(PRESETS[name])
    return CONFIG_MAPPING[spec.pop("model_type")](**spec, **SPECIAL_IDS)


def cache_dir() -> Path:
    return Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "ds-toolkit") / "shapes"


def dir_shape(path: Path) -> ModelShape:
    """A local HF model directory's shape, cached after the first meta-device read."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    from importlib.metadata import version

    key = hashlib.sha256(cfg_file.read_bytes() + version("transformers").encode()
                         + str(SHAPE_VERSION).encode()).hexdigest()[:24]
    cached = cache_dir() / f"{key}.json"
    if cached.is_file():
        try:
            return ModelShape.from_json(json.loads(cached.read_text()))
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable cache entry is read again below
    from transformers import AutoConfig

    shape = read_shape(AutoConfig.from_pretrained(path, local_files_only=True))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(shape.to_json()))
        tmp.replace(cached)
    except OSError:
        pass  # a read-only home only costs the next call the meta-device read
    return shape


def load_shape(model: str) -> ModelShape:
    """`--model PRESET|DIR` -> its shape; one clear error for anything else."""
    from toolkit.config.models import PRESETS

    if model in PRESETS:
        return preset_shape(model)
    from toolkit.hub import local_dir

    path = local_dir(model, files="config", what="--model")  # a hub id: config.json alone, never weights
    if path is not None:
        return dir_shape(path)
    raise ConfigError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}), a local model directory, nor a "
                      "hub id (org/name)")


_CONFIG_SHAPES: dict[tuple[str, bool], ModelShape] = {}


def shape_of_config(mc: Any, *, trace: bool = True) -> ModelShape:
    """The shape of an HF config object already in memory (train.py's), read once per process. trace=False: the
    parameters only (no activation trace: a second or more the caller does not need)."""
    key = mc.to_json_string(use_diff=False) if hasattr(mc, "to_json_string") else repr(mc)
    if (key, True) in _CONFIG_SHAPES:
        return _CONFIG_SHAPES[(key, True)]
    if (key, trace) not in _CONFIG_SHAPES:
        _CONFIG_SHAPES[(key, trace)] = read_shape(mc, trace=trace)
    return _CONFIG_SHAPES[(key, trace)]


def write_committed_shapes(names: list[str] | None = None) -> dict[str, Any]:
    """Read every preset on the meta device (python -m toolkit.plan.shapes rewrites the file)."""
    from toolkit.config.models import PRESETS

    out: dict[str, Any] = {}
    for name in names or list(PRESETS):
        out[name] = {"fingerprint": preset_fingerprint(name), "version": SHAPE_VERSION,
                     "shape": read_shape(preset_config(name)).to_json()}
    return out


if __name__ == "__main__":
    SHAPES_FILE.write_text(json.dumps(write_committed_shapes(), indent=1) + "\n")
    print(f"wrote {SHAPES_FILE}")
