"""The reference model of a preference run: never a full replica per GPU, never an optimizer for it.

- adapter: a LoRA run's reference is the policy itself with its adapters disabled (PEFT's `disable_adapter`): no
  extra weights, one more forward without gradients.
- engine: a full fine-tune's reference is a frozen copy, as a ZeRO-3 engine without an optimizer (DeepSpeed then
  builds its parameter-offload engine, for inference), whatever the policy's stage: each rank holds 1/world of it,
  optionally with its parameters on the CPU. TRL deep-copies the policy's config instead, so under ZeRO-1/2 its
  reference is a full bf16 replica on every GPU (../shared/notes/preference.md, section 1).
- precomputed: every pair's reference log-probs computed once, before training, by the policy itself
  (objectives/precompute.py); no reference model while training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from toolkit.config.ds_config import ConfigError

MODES = ("auto", "adapter", "engine", "precomputed")
# What a frozen model needs of the policy's DeepSpeed JSON: its precision and batch keys (DeepSpeed checks them)
KEPT = ("bf16", "fp16", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "communication_data_type", "seq_parallel_communication_data_type", "steps_per_print", "wall_clock_breakdown")
# ZeRO-3's own sizes, taken from the policy's where it sets them (they are tuned for the same model)
STAGE3_KEYS = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "reduce_bucket_size", "stage3_module_granularity_threshold")


def mode_of(requested: str, lora: bool) -> tuple[str, str]:
    """(mode, why) for pref.reference."""
    if requested not in MODES:
        raise ConfigError(f"pref.reference must be one of {', '.join(MODES)}, got {requested!r}")
    if requested == "adapter" and not lora:
        raise ConfigError("pref.reference=adapter needs lora.enabled=true (the reference is the base model with the "
                          "adapters off); use pref.reference=engine for a full fine-tune")
    if requested == "auto":
        if lora:
            return "adapter", "LoRA: the base model with the adapters disabled (no extra weights)"
        return "engine", "full fine-tune: a frozen copy sharded at ZeRO-3 (1/world of it per rank), no optimizer"
    if requested == "precomputed":
        return requested, ("pref.reference=precomputed: every pair's log-probs computed once before training by the "
                           "policy itself, cached; no reference model while training")
    return requested, f"pref.reference={requested}"


def reference_config(policy_ds: dict[str, Any], offload: bool = False) -> dict[str, Any]:
    """The frozen reference's DeepSpeed JSON from the policy's resolved one: ZeRO-3 at any policy stage, no
    optimizer or scheduler, the policy's precision and batch keys; offload puts its parameters on the CPU."""
    ds = {k: v for k, v in policy_ds.items() if k in KEPT}
    zero = {k: v for k, v in policy_ds.get("zero_optimization", {}).items() if k in STAGE3_KEYS}
    zero["stage"] = 3
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds["zero_optimization"] = zero
    return ds


def build_engine(model: Any, ds: dict[str, Any]) -> Any:
    """A frozen model as a ZeRO-3 inference engine (build `model` while an HfDeepSpeedConfig of `ds` is alive, so
    its weights load straight into partitions)."""
    import deepspeed

    model.requires_grad_(False)
    model.eval()
    if "optimizer" in ds or ds.get("zero_optimization", {}).get("stage") != 3:
        raise ValueError("a reference engine takes reference_config's JSON: ZeRO-3, no optimizer")
    return deepspeed.initialize(model=model, config=ds)[0]


def disable_dropout(model: Any) -> None:
    """Dropout off in the policy and the reference of a preference run, as TRL's disable_dropout (its default):
    with it the reference's log-probs would be noise, and the policy's first step could not equal it."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for m in model.modules():  # attention dropout that transformers reads from a float attribute, not a module
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


@contextlib.contextmanager
def adapters_off(engine_or_model: Any) -> Iterator[None]:
    """The LoRA policy as its own reference for the length of the block (PEFT's disable_adapter)."""
    model = getattr(engine_or_model, "module", engine_or_model)
    if not hasattr(model, "disable_adapter"):
        raise RuntimeError("pref.reference=adapter needs a PEFT model")
    with model.disable_adapter():
        yield


def _leaves(cfg: Any, model: Any, model_config: Any) -> None:
    """The reference's decoder layers as ZeRO-3 leaf modules where train.zero3_leaves makes a policy's so (the
    reference is ZeRO-3 whatever the policy's stage): one gather a layer for its forward instead of a hook on each
    submodule. It runs no backward, so the leaf's gradient hook never matters."""
    from deepspeed.utils import set_z3_leaf_modules

    from toolkit.plan.speedups import reference_leaves
    from toolkit.runtime.speed.compile import decoder_layers

    on = reference_leaves(cfg.train.zero3_leaves, model_type=str(getattr(model_config, "model_type", "")),
                          objective=cfg.train.objective)
    layers = decoder_layers(model)
    if on and layers:
        set_z3_leaf_modules(model, [type(layers[0])])


def build_reference(cfg: Any, model_config: Any, policy_ds: dict[str, Any], policy_alive: Any, resolved: Any) -> Any:
    """The frozen ZeRO-3 reference engine of a full fine-tune, built from the policy's starting weights (the same
    preset seed or model directory, without LoRA) with the policy's attention and Liger kernels, so that at step 1
    both compute the same log-probs (in bf16 another kernel alone moved DPO's first loss from ln 2 to 0.78 on
    llama-1b). `policy_alive`: the policy's HfDeepSpeedConfig, made current again afterwards (transformers reads
    the newest one, and the policy's stage is the run's)."""
    import dataclasses

    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import set_hf_deepspeed_config

    from toolkit.runtime.model import build_model
    from toolkit.runtime.speed import kernels

    ds = reference_config(policy_ds, cfg.pref.reference_offload)
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False))
    alive = HfDeepSpeedConfig(ds)  # noqa: F841 (zero.Init while the model is built: its weights load into partitions)
    # a 4-bit policy's reference is its 4-bit base, stored in the run's dtype like the policy's
    model = build_model(plain, model_config, attn=resolved.attention.implementation, precision=resolved.precision)
    kernels.apply(model, resolved.liger)
    disable_dropout(model)
    _leaves(cfg, model, model_config)
    if isinstance(policy_alive, HfDeepSpeedConfig):
        set_hf_deepspeed_config(policy_alive)
    return build_engine(model, ds)
