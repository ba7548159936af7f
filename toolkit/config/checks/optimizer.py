"""Optimizer x offload: which optimizer (config section or client) DeepSpeed accepts, and at what
cost, under offload_optimizer."""

from __future__ import annotations

import functools
import importlib.util

from toolkit.config.checks.base import Ctx, Finding, _err, _warn

# deepspeed/runtime/engine.py _configure_basic_optimizer: with offload these config types become
# DeepSpeedCPUAdam (adam, adamw), DeepSpeedCPUAdagrad, DeepSpeedCPULion; lamb becomes FusedLamb (GPU only).
# Muon: its Adam half becomes DeepSpeedCPUAdam, and the ZeRO optimizer orthogonalizes the matrices' updates on the
# accelerator before the CPU step (stage_1_and_2.py _apply_muon_updates_cpu_offload, stage3.py).
_CPU_CONFIG_OPTIMIZERS = {"adam", "adamw", "adagrad", "lion", "muon"}
_ONE_BIT = {"onebitadam", "zerooneadam", "onebitlamb"}
# engine._configure_optimizer: a client optimizer under offload must be an instance of one of these
# two, else ZeRORuntimeException unless zero_force_ds_cpu_optimizer is false. DeepSpeedCPUAdagrad is
# NOT in that isinstance check (it does not subclass DeepSpeedCPUAdam), so as a client it is refused too.
_CPU_CLIENT_OPTIMIZERS = {"deepspeedcpuadam", "deepspeedcpulion"}


def _opt_type(c: Ctx) -> str | None:
    opt = c.raw.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("type"), str):
        return opt["type"]
    return None


def _one_bit_available() -> bool:
    try:
        return importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        return False


def rule_optimizer(c: Ctx) -> list[Finding]:
    out: list[Finding] = []
    dev, _ = c.offload("offload_optimizer")
    offloaded = dev in ("cpu", "nvme")
    typ = _opt_type(c)
    if typ is not None:
        low = typ.lower()
        if low in _ONE_BIT:
            why = (
                []
                if _one_bit_available()
                else [
                    "this DeepSpeed has no 1-bit optimizers (removed), "
                    "so initialize fails with 'not a supported DeepSpeed Optimizer'"
                ]
            )
            if c.stage > 0:
                why.append(f"1-bit optimizers do not support ZeRO stage {c.stage}")
            if why:
                out.append(_err("optimizer.type", f"{typ}: " + "; ".join(why) + "; use Adam/AdamW"))
            return out
        if not _is_supported_optimizer_name(typ):
            out.append(
                _err(
                    "optimizer.type",
                    f"{typ!r} is neither a DeepSpeed optimizer "
                    f"({', '.join(_ds_optimizers())}) nor a torch.optim class",
                )
            )
            return out
        if offloaded and low == "lamb":
            out.append(
                _err(
                    "optimizer.type",
                    "LAMB has no CPU implementation (DeepSpeed builds FusedLamb, GPU "
                    "only); use Adam/AdamW with offload_optimizer, or drop the offload",
                )
            )
        elif offloaded and low in ("adam", "adamw"):
            params = c.raw["optimizer"].get("params")
            if isinstance(params, dict) and params.get("torch_adam") is True:
                out.append(
                    _warn(
                        "optimizer.params.torch_adam",
                        "true under offload_optimizer runs torch's Adam "
                        "on the CPU instead of DeepSpeedCPUAdam (several times slower); remove it",
                    )
                )
        elif offloaded and low not in _CPU_CONFIG_OPTIMIZERS:
            out.append(
                _warn(
                    "optimizer.type",
                    f"{typ} has no DeepSpeed CPU version: under offload it runs as "
                    "a plain torch optimizer on the CPU (slow); Adam/AdamW/Adagrad/Lion have one",
                )
            )
        if c.optimizer:
            out.append(
                _warn(
                    "optimizer",
                    f"the config has an optimizer section and --optimizer {c.optimizer} "
                    "was given; the Trainer uses the section, raw deepspeed.initialize the client one",
                )
            )
        return out
    if not offloaded:
        return out
    force = c.raw.get("zero_force_ds_cpu_optimizer", True) is not False
    key = "zero_optimization.offload_optimizer"
    if c.via_accelerate and force:
        # HF Trainer goes through Accelerate, which swaps a client torch/bnb Adam, AdamW, Adagrad or
        # Lion (and the Trainer's own default AdamW) for DeepSpeed's CPU version under offload
        # (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed): those run. Anything else is
        # silently replaced by DeepSpeedCPUAdam, its fallback.
        name = (c.optimizer or "torch.adamw").rsplit(".", 1)[-1].lower()
        if not any(k in name for k in ("adam", "adagrad", "lion")):
            out.append(
                _warn(
                    key,
                    f"under offload Accelerate replaces client optimizer {c.optimizer} with "
                    "DeepSpeedCPUAdam; use Adam/AdamW/Adagrad/Lion or an optimizer section",
                )
            )
        return out
    if c.optimizer:
        name = c.optimizer.rsplit(".", 1)[-1].lower()
        if name in _CPU_CLIENT_OPTIMIZERS:
            return out
        msg = (
            f"client optimizer {c.optimizer} is not DeepSpeedCPUAdam/DeepSpeedCPULion; DeepSpeed "
            "{verb} (engine._configure_optimizer). Add an optimizer section (e.g. from `toolkit gen-config`) "
            "or pass DeepSpeedCPUAdam"
        )
        if force:
            out.append(_err(key, msg.format(verb="raises ZeRORuntimeException at initialize")))
        else:
            out.append(
                _warn(
                    key,
                    msg.format(
                        verb="allows it only because zero_force_ds_cpu_optimizer is "
                        "false: the step runs as torch code on the CPU (slow)"
                    ),
                )
            )
    elif c.via_accelerate and force:
        out.append(
            _err(
                key,
                "no optimizer section: HF Trainer then creates torch AdamW, which DeepSpeed refuses "
                "under offload; add an optimizer section, e.g. from `toolkit gen-config`",
            )
        )
    elif c.via_accelerate:
        out.append(
            _warn(
                key,
                "no optimizer section: HF Trainer creates torch AdamW, allowed only because "
                "zero_force_ds_cpu_optimizer is false; its step runs as torch code on the CPU (slow). "
                "Add an optimizer section, e.g. from `toolkit gen-config`",
            )
        )
    else:
        out.append(
            _warn(
                key,
                "no optimizer section: the raw loop's client optimizer must be DeepSpeedCPUAdam "
                "(or DeepSpeedCPULion), else initialize raises",
            )
        )
    return out


@functools.cache
def _ds_optimizers() -> tuple[str, ...]:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return tuple(DEEPSPEED_OPTIMIZERS)


def _is_supported_optimizer_name(name: str) -> bool:
    # engine._is_supported_optimizer, after DeepSpeedConfig lower-cases the DeepSpeed names
    import torch

    return name.lower() in _ds_optimizers() or getattr(torch.optim, name, None) is not None
