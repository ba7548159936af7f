"""The optimizer a DeepSpeed dict asks for, and what it costs: AdamW or Muon, fp32 or bf16 master weights and states.

Pure dict code, like ds_config.py: gen-config writes these keys, `toolkit check` refuses what DeepSpeed rejects or
silently mis-runs (config/checks/muon.py), the run resolves its gradient clipping from them, and the planner counts
their bytes a parameter (plan/planner.py). What each choice costs and saves, measured: docs/optimizers.md.

DeepSpeed's keys (deepspeed 0.19, read from its code):
  "optimizer": {"type": "Muon", "params": {"lr", "muon_lr", "adam_lr", "momentum", "betas", "eps", "weight_decay",
               "ns_method"}}: deepspeed.initialize tags every parameter whose layer shape is 2-D and whose name has
               no "embed" or "lm_head" with use_muon (deepspeed/__init__.py set_optimizer_flags); those train with
               Muon at muon_lr (else lr), the rest (embeddings, head, norms, biases) with Adam at adam_lr (else lr).
  "bf16": {"bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}: the ZeRO optimizer keeps its
               master copy, gradient partitions and Adam moments in bf16 (runtime/base_optimizer.py
               _configure_master_weights); ZeRO 1-3 only.
"""

from __future__ import annotations

from typing import Any, Literal

OptimizerName = Literal["adamw", "muon"]
States = Literal["fp32", "bf16"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "muon")
STATES: tuple[States, ...] = ("fp32", "bf16")

# DeepSpeed's own defaults for Muon's half (deepspeed/runtime/zero/muon/original_muon.py MuonWithAuxAdam: lr 0.02,
# momentum 0.95, Keller Jordan's values); its Adam half takes the run's lr, betas and eps.
MUON_LR = 0.02
MUON_MOMENTUM = 0.95
# DeepSpeed's gradient_clipping when the key is absent (deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT)
DS_DEFAULT_CLIP = 1.0


def _block(ds: dict[str, Any], key: str) -> dict[str, Any]:
    v = ds.get(key)
    return v if isinstance(v, dict) else {}


def optimizer_type(ds: dict[str, Any]) -> str | None:
    """The optimizer section's type, lower-cased as DeepSpeedConfig reads it; None without a section."""
    typ = _block(ds, "optimizer").get("type")
    return typ.lower() if isinstance(typ, str) else None


def is_muon(ds: dict[str, Any]) -> bool:
    return optimizer_type(ds) == "muon"


def master_bf16(ds: dict[str, Any]) -> bool:
    return _block(ds, "bf16").get("bf16_master_weights_and_grads") is True


def states_bf16(ds: dict[str, Any]) -> bool:
    return _block(ds, "bf16").get("bf16_optimizer_states") is True


def states_of(ds: dict[str, Any]) -> States:
    """bf16 where DeepSpeed keeps master weights, gradients and moments in bf16, else fp32."""
    return "bf16" if master_bf16(ds) and states_bf16(ds) else "fp32"


def stochastic_rounding_blocker(ds: dict[str, Any]) -> str | None:
    """Why torchao's stochastic-rounding AdamW cannot take the place of DeepSpeed's optimizer here; None where it can
    (bf16 master weights and states, AdamW, stepped on the GPU). toolkit/runtime/low_precision.py says why it helps."""
    if states_of(ds) != "bf16":
        return "the master weights and states are not bf16 (bf16_master_weights_and_grads + bf16_optimizer_states)"
    typ = optimizer_type(ds)
    params = _block(ds, "optimizer").get("params")
    params = params if isinstance(params, dict) else {}
    if typ not in ("adam", "adamw"):
        return f"the optimizer is {typ or 'a client one'}, not AdamW"
    if typ == "adam" and params.get("adam_w_mode") is False:
        return "Adam with adam_w_mode false (L2 decay, not AdamW's)"
    offload = _block(_block(ds, "zero_optimization"), "offload_optimizer").get("device")
    if offload not in (None, "none"):
        return f"the optimizer steps on the {offload} (offload_optimizer: DeepSpeedCPUAdam)"
    return None


def clips_muon_update(ds: dict[str, Any], stage: int) -> bool:
    """Where DeepSpeed applies gradient_clipping to Muon's orthogonalized update rather than to the gradient.

    ZeRO 1-3 write Muon's update into the gradient partition (stage_1_and_2.py get_flat_partition, stage3.py
    _muon_update_sub_group) before unscale_and_clip_grads scales the partitions by the clip over their total norm.
    An orthogonalized update has a norm of about sqrt(rows) per matrix whatever the gradient, so a clip of 1.0 shrinks
    every step by the norm of all of them together (measured on a 2-layer model, 2 ranks: 21x; the weights moved as
    if muon_lr were 20x smaller). At ZeRO-0 the engine clips the gradients before Muon runs, as torch does."""
    return is_muon(ds) and stage >= 1


def default_grad_clip(ds: dict[str, Any]) -> float:
    """train.grad_clip left unset: 1.0 (the HF Trainer's max_grad_norm), or off with Muon at every stage: ZeRO 1-3
    cannot clip its gradients (`clips_muon_update`), and a ZeRO-0 run then trains as they do (Muon's own recipe
    clips nothing: its update's size is set by orthogonalization)."""
    return 0.0 if is_muon(ds) else 1.0


def bytes_per_param(optimizer: OptimizerName, states: States, matrix: bool, stage: int = 2,
                    shared_master: bool = False) -> float:
    """Bytes of optimizer state a trained parameter keeps on the rank that owns its partition: the master copy and
    the moments. AdamW: master + m + v; Muon's matrices: master + one momentum buffer (its other parameters are
    Adam's). fp32: 4 bytes each; bf16 master weights and states: 2. shared_master: bf16 masters on the GPU are the
    bf16 weights themselves (toolkit/runtime/low_precision.py share_masters), so they cost nothing more. Muon's
    momentum at ZeRO-3 is kept in the communication dtype (stage3.py _create_momentum_buffer: bf16 in a bf16 run);
    measured on llama-1b, one H200, bench/results/optimizers/speed_llama1b: Muon saved 3.6 GiB against AdamW at
    ZeRO-2 (4 bytes a matrix parameter) and 5.4 GiB at ZeRO-3 (6)."""
    width = 4.0 if states == "fp32" else 2.0
    master = 0.0 if shared_master and states == "bf16" else width
    if optimizer == "muon" and matrix:
        return master + (2.0 if stage == 3 else width)
    return master + 2 * width
