"""Muon and low-precision optimizer states: what DeepSpeed 0.19 rejects at initialize, or runs wrongly without a word.

Each rule is read from DeepSpeed's code (the file and function named in the message's comment) and was seen on two CPU
ranks (docs/optimizers.md "What toolkit check refuses").
"""

from __future__ import annotations

from toolkit.config import optimizers as opt
from toolkit.config.checks.base import Ctx, Finding, _err, _warn

# deepspeed/runtime/lr_schedules.py: these broadcast one scalar lr to every param group (_format_param), so Muon's
# muon_lr becomes the Adam half's; WarmupCosineLR scales each group's own lr and keeps it.
_ONE_LR_SCHEDULERS = {"warmuplr": "warmup_max_lr", "warmupdecaylr": "warmup_max_lr", "onecycle": "cycle_max_lr",
                      "lrrangetest": "lr_range_test_min_lr"}


def rule_muon(c: Ctx) -> list[Finding]:
    if not opt.is_muon(c.raw):
        return []
    out: list[Finding] = []
    zero = c.zero
    if c.stage == 3 and zero.get("reduce_scatter", True) is not False:
        # stage3.py DeepSpeedZeroOptimizer_Stage3.__init__; reduce_scatter defaults to true (zero/config.py)
        out.append(_err("zero_optimization.reduce_scatter",
                        f"{'true' if 'reduce_scatter' in zero else 'absent (DeepSpeed: true)'} with Muon at ZeRO-3: "
                        "initialize raises 'Muon and reduce scatter cannot be used together'; set it to false"))
    if c.stage == 3 and zero.get("zero_quantized_gradients") is True:
        # engine.py: qgZ builds the all-to-all group that stage3.py refuses with Muon
        out.append(_err("zero_optimization.zero_quantized_gradients",
                        "true with Muon at ZeRO-3: initialize raises 'Muon and all2all process group cannot be used "
                        "together'; drop it"))
    if opt.clips_muon_update(c.raw, c.stage):
        clip = c.raw.get("gradient_clipping", None)
        why = (f"at ZeRO-{c.stage} DeepSpeed clips Muon's orthogonalized update, not the gradient: each step shrinks "
               "by the norm of all the updates (about sqrt(rows) a matrix), silently")
        if clip is None:
            out.append(_err("gradient_clipping", f"absent, so DeepSpeed's default {opt.DS_DEFAULT_CLIP}: {why}; "
                                                 "set it to 0"))
        elif clip == "auto" and c.consumer in ("hf-trainer", "accelerate"):
            out.append(_warn("gradient_clipping", f"\"auto\" takes the HF Trainer's max_grad_norm (1.0 unless set): "
                                                  f"{why}; run with max_grad_norm=0"))
        elif isinstance(clip, (int, float)) and clip > 0:
            out.append(_err("gradient_clipping", f"{clip}: {why}; set it to 0"))
        elif clip == 0 and c.consumer in ("hf-trainer", "accelerate"):
            out.append(_warn("gradient_clipping", "0 (off, as Muon at ZeRO 1-3 needs): a plain HF Trainer raises on "
                                                  "the mismatch unless it runs with max_grad_norm=0"))
    sched = c.raw.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("type"), str):
        key = _ONE_LR_SCHEDULERS.get(sched["type"].lower())
        params = sched.get("params") if isinstance(sched.get("params"), dict) else {}
        if key and not isinstance(params.get(key), list):
            out.append(_err("scheduler.type", f"{sched['type']} sets one lr on every param group, so Muon's "
                                              "matrices would step at the Adam half's lr (muon_lr lost); use "
                                              "WarmupCosineLR, or no scheduler section (the toolkit's schedule)"))
    if opt.master_bf16(c.raw) and c.offload("offload_optimizer")[0] != "none":
        # base_optimizer.py _configure_master_weights: offloaded bf16 masters need DeepSpeedCPUAdam
        out.append(_err("bf16.bf16_master_weights_and_grads",
                        "with Muon and offload_optimizer: DeepSpeed keeps offloaded bf16 master weights only with "
                        "DeepSpeedCPUAdam; drop the offload or keep fp32 states"))
    return out


def rule_low_precision_states(c: Ctx) -> list[Finding]:
    """bf16_master_weights_and_grads and bf16_optimizer_states (runtime/config.py _do_error_check,
    base_optimizer.py _configure_master_weights)."""
    master, states = opt.master_bf16(c.raw), opt.states_bf16(c.raw)
    if not (master or states):
        return []
    key = "bf16.bf16_optimizer_states" if states else "bf16.bf16_master_weights_and_grads"
    if c.stage == 0:
        return [_err(key, "needs ZeRO stage 1, 2 or 3: DeepSpeed keeps master weights and states in its ZeRO "
                          "optimizer only")]
    if states and not master:
        return [_err("bf16.bf16_optimizer_states", "needs bf16.bf16_master_weights_and_grads: true as well")]
    enabled = (c.raw.get("bf16") or {}).get("enabled")
    if enabled is not True and enabled != "auto":
        return [_err(key, "without bf16.enabled: the run trains in another precision while DeepSpeed rounds its "
                          "master weights to bf16 every step; enable bf16 or drop it")]
    dev = c.offload("offload_optimizer")[0]
    if master and not states and dev == "none":
        return [_err("bf16.bf16_master_weights_and_grads",
                     "without bf16_optimizer_states needs optimizer offload to the CPU (DeepSpeedCPUAdam keeps fp32 "
                     "moments there): add bf16_optimizer_states: true to keep everything on the GPU, or offload")]
    typ = opt.optimizer_type(c.raw)
    if dev != "none" and typ not in ("adam", "adamw", "muon"):  # muon: rule_muon says it
        return [_err(key, f"with offload_optimizer needs DeepSpeedCPUAdam (optimizer type Adam or AdamW), not "
                          f"{typ or 'a client optimizer'}")]
    return []
