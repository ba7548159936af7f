"""Models: named presets built from a config (random init, no download) or a local HF directory.

Under ZeRO-3 the caller must keep an HfDeepSpeedConfig (or the TrainingArguments that own one)
alive BEFORE calling `build_model`: transformers then constructs the model inside zero.Init, so
no rank ever holds the full model. `check_init` guards the second half of that rule: weights must
be really initialized, not left as whatever memory zero.Init handed out.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.config.models import PRESETS, SPECIAL_IDS, extend_positions, positions_hint
from toolkit.config.schema import Config


def is_preset(name: str) -> bool:
    return name in PRESETS


def model_path(cfg: Config, files: str = "model") -> Path:
    """The local directory of model.name: the directory itself, or a hub id's pinned snapshot (toolkit/hub;
    files="config": config.json alone, for plan and check). ConfigError for anything else."""
    from toolkit.hub import local_dir

    name = cfg.model.name
    path = local_dir(name, cfg.model.revision, files=files, trust_remote_code=cfg.model.trust_remote_code)
    if path is None:
        raise ConfigError(f"model.name: {name!r} is neither a preset ({', '.join(PRESETS)}), a local model "
                          "directory, nor a hub id (org/name)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.name: {path} has no config.json; is it a Hugging Face model directory?")
    return path


def custom_code(cfg: Config, path: Path) -> bool:
    """model.trust_remote_code as every from_pretrained takes it (always a bool: None would prompt with input()
    on every rank); a model whose config asks for its own Python is refused without it."""
    from toolkit.hub import has_custom_code

    custom = has_custom_code(path)
    if custom and not cfg.model.trust_remote_code:
        raise ConfigError(f"model.name={cfg.model.name}: its config asks for the repository's own Python (auto_map); "
                          "set model.trust_remote_code=true to run it (pinned to the resolved commit), or use a "
                          "model transformers ships")
    if custom and path not in _WARNED and os.environ.get("RANK", "0") == "0":
        _WARNED.add(path)
        print(f"warning: model.trust_remote_code=true: {cfg.model.name} runs its repository's own Python "
              f"({path}); read it before you train on it", flush=True)
    return bool(cfg.model.trust_remote_code)


_WARNED: set[Path] = set()


def model_config(cfg: Config, files: str = "model") -> Any:
    """The HF config of the model, without building it: sizes for "auto", seq-length checks. files: what a hub
    id fetches ("model": everything a run reads; "config": config.json alone)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    name = cfg.model.name
    if is_preset(name):
        spec = dict(PRESETS[name])
        kind = CONFIG_MAPPING[spec.pop("model_type")]
        if cfg.model.num_layers:  # before the config is built: Qwen3-MoE derives per-layer lists from the count
            from toolkit.plan.trace import stack_configs

            if stack_configs(kind(**spec)):  # BLT: the count would be set on its config and read by none of its stacks
                raise ConfigError(f"model.num_layers cuts one stack of decoder layers; {name} is built of layer "
                                  "stacks of their own widths: set each stack's num_hidden_layers in a config")
            spec["n_layer" if "n_layer" in spec else "num_hidden_layers"] = cfg.model.num_layers
        mc = kind(**spec, **SPECIAL_IDS)
    else:
        if cfg.model.num_layers:
            raise ConfigError(f"model.num_layers applies to presets; {name} is a directory: its config.json's "
                              "layer count is what its weights hold")
        path = model_path(cfg, files)
        mc = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=custom_code(cfg, path))
    if cfg.model.task == "seq_cls":  # a reward model (train.objective=reward) scores a sequence with one output
        mc.num_labels = 1 if cfg.train.objective == "reward" else cfg.model.num_labels
    # No KV cache in training forwards: a forward builds one whenever config.use_cache is on, and nothing of it
    # serves training. Under packing transformers reads packed position ids as separate sequences only when no cache
    # is passed (masking_utils._preprocess_mask_arguments); and a DynamicCache initializes each layer's cache with a
    # copy that synchronizes the stream: 22 a step for Gemma-3-1B at micro 4, a step bound by the host, 1.15x without
    # them (bench/profile_syncs.py; bench/results/speed_model/README.md). The toolkit's generate asks
    # for its cache (generation/batched.py), and an exported model's config says use_cache again
    # (faults/checkpoint.export_model).
    mc.use_cache = False
    if cfg.model.rope_factor != 1:
        if getattr(mc, "max_position_embeddings", None) is None:
            raise ConfigError(f"model.rope_factor: a {mc.model_type} model has no rotary positions to extend")
        extend_positions(mc, cfg.model.rope_factor)
    limit = getattr(mc, "max_position_embeddings", None) or getattr(mc, "n_positions", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is above the model's maximum of {limit} positions; "
                          + positions_hint(limit))
    return mc


def hidden_size(mc: Any) -> int:
    width = getattr(mc, "hidden_size", None) or getattr(mc, "n_embd", None)
    if width is None and getattr(getattr(mc, "decoder_config", None), "hidden_size", None):
        # stacks of their own widths, none the config's own (BLT): its decoder's, under the head, as toolkit plan
        # reads it (shapes._top_config), so the ZeRO sizes derived from it are the plan's
        width = mc.decoder_config.hidden_size
    return int(width if width is not None else mc.n_embd)


def build_tokenizer(cfg: Config) -> Any | None:
    if cfg.model.tokenizer is None and is_preset(cfg.model.name):
        return None
    from transformers import AutoTokenizer

    from toolkit.hub import local_dir

    if cfg.model.tokenizer is None:
        path = model_path(cfg)
    else:
        path = local_dir(cfg.model.tokenizer, files="tokenizer", what="model.tokenizer")
        if path is None:
            raise ConfigError(f"model.tokenizer: {cfg.model.tokenizer} is neither a local directory nor a hub id")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                        trust_remote_code=bool(cfg.model.trust_remote_code))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_model(cfg: Config, mc: Any, frozen_bf16: bool = False, attn: str | None = None,
                precision: str | None = None) -> Any:
    """Build (random init from a preset, or from_pretrained from a directory), then LoRA/checkpointing.

    attn: the attention implementation to build with (the resolved record's attention plan, toolkit/runtime/resolved.py); default
    model.attn_implementation.

    frozen_bf16 (LoRA under adapter autocast, see ds_config.adapter_autocast): every parameter that
    does not train becomes bf16, the adapters stay fp32. Buffers keep their dtype (rotary inv_freq).

    precision (needed with model.load_in_4bit): the run's, whose float dtype the 4-bit weights are stored and
    computed in (toolkit/runtime/quant). The base is built outside zero.Init, as transformers builds quantized models:
    ZeRO-3 shards the packed weights at deepspeed.initialize.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from toolkit.config.checkpoint import checkpoint_files, model_keys
    from toolkit.runtime import quant
    from toolkit.runtime.faults import load_report

    auto = AutoModelForSequenceClassification if cfg.model.task == "seq_cls" else AutoModelForCausalLM
    kwargs = dict(attn_implementation=attn or cfg.model.attn_implementation, dtype=torch.float32)
    n = 0
    if cfg.model.load_in_4bit:
        from toolkit.launch import dist

        if precision is None:
            raise ValueError("build_model: model.load_in_4bit needs the run's precision (the storage dtype)")
        four_bit = dict(dtype=quant.storage_dtype(precision), quant_type=cfg.model.bnb_4bit_quant_type,
                        device=dist.device())
    path = None if is_preset(cfg.model.name) else model_path(cfg)
    if path is not None:
        kwargs["trust_remote_code"] = custom_code(cfg, path)
    report = None if path is None else load_report.check(
        path, auto, mc, kwargs, cfg.model.task, list(cfg.model.new_weights))
    error = report and report.error(cfg.model.name)
    if error:  # before a weight is read: every rank reads the same index and stops alike
        raise ConfigError(error)
    with quant.without_zero_init(cfg.model.load_in_4bit):
        # a 4-bit base is quantized while it is built or read, module by module: the float model is never whole
        files = None if path is None or not cfg.model.load_in_4bit else checkpoint_files(
            str(path), model_keys(auto, mc, kwargs))
        if cfg.model.load_in_4bit and (is_preset(cfg.model.name) or files is not None):
            model, n = quant.build_4bit(auto, mc, cfg.train.seed, kwargs, **four_bit, weights=files)
        elif is_preset(cfg.model.name):
            model = _random_init(auto, mc, cfg.train.seed, kwargs)
        else:
            model, info = auto.from_pretrained(path, config=mc, local_files_only=True,
                                               output_loading_info=True, **kwargs)
            load_report.after_load(report, info, list(cfg.model.new_weights))
    if cfg.model.load_in_4bit:
        dtype = four_bit["dtype"]
        if not n:  # a directory whose names transformers converts: loaded whole, then each Linear quantized in place
            n = quant.quantize_4bit(model, **four_bit)
        if dist.rank() == 0:
            name = str(dtype).removeprefix("torch.")
            print(f"model.load_in_4bit: {n} Linear layers in 4-bit {cfg.model.bnb_4bit_quant_type} (double "
                  f"quantization), stored and computed in {name}; the head stays {name}", flush=True)
    if cfg.model.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:  # transformers raises a bare ValueError
            raise ConfigError(f"model.gradient_checkpointing=true: transformers has no checkpointing for "
                              f"{type(model).__name__} (Reformer's reversible layers recompute in backward already); "
                              "set model.gradient_checkpointing=false")
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        model = apply_lora(cfg, model)
    if attn is not None:
        from toolkit.runtime.attention.interface import NAME, watch_boundaries

        if attn == NAME:
            watch_boundaries(model)
    if frozen_bf16:
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    model.toolkit_load_report = report  # what the checkpoint held (None for a preset): said and kept by the loop
    return model


def _random_init(auto: Any, mc: Any, seed: int, kwargs: dict[str, Any]) -> Any:
    """Random init that gives the same weights at every ZeRO stage, on every rank, on CPU and GPU.

    A plain build draws torch's default init in the constructors; building without init and then
    running transformers' `initialize_weights` walk makes every stage consume one stream in one
    order. Under ZeRO-3 transformers builds inside zero.Init and runs the same walk on rank 0 over
    gathered parameters, which on a GPU live on the GPU and draw from the CUDA generator: ZeRO-3 then
    started from other weights than ZeRO-2 (GPT-2 after 25 steps: 10.18 vs 10.81). `_init_zero3_on_cpu`
    replaces that walk with the same walk drawing from the CPU generator, like every other stage.
    """
    from unittest import mock

    import torch
    from transformers.initialization import guard_torch_init_functions, no_init_weights
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        from transformers import PreTrainedModel

        # transformers imports its ZeRO-3 init helper at call time, so the patch reaches it, and
        # ties the weights right after; both wait for the walk below. Tying first would make the
        # walk draw the tied matrix once (as lm_head) where every other stage draws the embedding,
        # then the head, then ties: other weights for every tied-embedding model.
        skipped: list[Any] = []
        with mock.patch("transformers.integrations.deepspeed.initialize_weights_zero3", skipped.append), \
                mock.patch.object(PreTrainedModel, "tie_weights", lambda self, *a, **k: None):
            model = auto.from_config(mc, **kwargs)
        if not skipped:  # transformers changed how it calls the helper: fail loudly, not differently
            raise RuntimeError("transformers no longer calls integrations.deepspeed.initialize_weights_zero3; "
                               "toolkit/runtime/model.py's ZeRO-3 random init needs updating")
        torch.manual_seed(seed)
        _init_zero3_on_cpu(model)
        model.tie_weights()
        return model
    torch.manual_seed(seed)
    with no_init_weights():
        model = auto.from_config(mc, **kwargs)
    torch.manual_seed(seed)
    with torch.no_grad(), guard_torch_init_functions():
        model.initialize_weights()
    model.tie_weights()
    return model


def _init_zero3_on_cpu(model: Any) -> None:
    """transformers' `initialize_weights_zero3` walk (children first, each module with its direct
    children's parameters gathered, rank 0 initializes), with the gathered tensors swapped for CPU
    copies during init so the CPU generator draws, as at every other stage."""
    import deepspeed
    import torch
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()  # what PreTrainedModel.initialize_weights passes

    def walk(module: Any, fn: Any) -> None:
        for child in module.children():
            walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        params = {id(p): p for p in module.parameters(recurse=False)}
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params |= {id(p): p for p in child.parameters(recurse=False)}
        if not params:
            fn(module, custom)
            return
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                device_data = {k: p.data for k, p in params.items()}
                for p in params.values():
                    # fp32 like the other stages, which draw before DeepSpeed casts (bf16 draws
                    # other values and can shift the stream)
                    p.data = p.data.to("cpu", dtype=torch.float32, copy=True)
                fn(module, custom)
                for k, p in params.items():
                    device_data[k].copy_(p.data)
                    p.data = device_data[k]

    with torch.no_grad(), guard_torch_init_functions():
        walk(model, model._initialize_weights)


def apply_lora(cfg: Config, model: Any) -> Any:
    from peft import LoraConfig, TaskType, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg.lora.target_modules if t not in names]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing} not found in the model; "
                          f"linear layers include e.g. {sorted(n for n in names if 'proj' in n or 'dense' in n)[:8]}")
    task = TaskType.SEQ_CLS if cfg.model.task == "seq_cls" else TaskType.CAUSAL_LM
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=list(cfg.lora.target_modules), task_type=task)
    return get_peft_model(model, lcfg)


def check_first_loss(loss: float, vocab_size: int, task: str, pretrained: bool) -> str | None:
    """A random-init LM starts near ln(vocab). Far above it means uninitialized weights (ZeRO-3 trap)."""
    if pretrained or task != "causal_lm" or not math.isfinite(loss):
        return None if math.isfinite(loss) else f"first loss is {loss}: weights or data are broken"
    expected = math.log(vocab_size)
    if loss > 1.5 * expected:
        return (f"first loss {loss:.2f} is far above ln(vocab)={expected:.2f}: the model looks uninitialized "
                "(under ZeRO-3 a model built inside zero.Init must have its weights initialized)")
    return None


def check_zero3_leaves(model: Any) -> str | None:
    """A ZeRO-3 leaf module that holds the input embeddings trains on no gradient: refuse it.

    DeepSpeed reduces a leaf module's gradients in the module's full backward hook, and that hook fires
    only when a gradient flows to the module's inputs. The model and its backbone take token ids (no
    gradient), so as leaves their parameters are never reduced: the optimizer steps on zeros and the
    gradient norm reads 0.0, without an error. `stage3_module_granularity_threshold` picks leaves
    parent-first (parameters per layer), so any threshold above a layer's makes the whole model or its
    backbone the leaf (bench/zero3_leaf.py, 2 CPU ranks, DeepSpeed 0.19.8: gradient norm 0.0 with the whole
    model as the leaf, 0.72 instead of 1.22 with the backbone; decoder layers as leaves match no leaves)."""
    from deepspeed.utils import get_z3_leaf_modules

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        return None
    bad = [type(m).__name__ for m in get_z3_leaf_modules(model) if any(x is embed for x in m.modules())]
    if not bad:
        return None
    return (f"ZeRO-3 leaf module {bad[0]} holds the input embeddings: it takes token ids, so its backward hook "
            "never fires and its parameters would train on no gradient. Lower "
            "zero_optimization.stage3_module_granularity_threshold below the granularity DeepSpeed logs for the "
            "decoder layer (or 0), or name the decoder layer class in zero_optimization.leaf_module")

