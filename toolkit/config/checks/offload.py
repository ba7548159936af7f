"""Stage x offload (which stage each offload needs, partial offload), the NVMe directory, and
precision (fp16/bf16/torch_autocast)."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.config.checks.base import Ctx, Finding, _err, _warn


def rule_offload(c: Ctx) -> list[Finding]:
    out: list[Finding] = []
    pdev, _ = c.offload("offload_param")
    odev, oblock = c.offload("offload_optimizer")
    if pdev != "none" and c.stage != 3:
        out.append(
            _warn(
                "zero_optimization.offload_param",
                f"ignored at stage {c.stage}: parameter offload needs stage 3; remove it or set stage 3",
            )
        )
    if odev != "none" and c.stage == 0:
        out.append(_err("zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3 (stage is 0)"))
    ratio = oblock.get("ratio", 1.0)
    if isinstance(ratio, (int, float)) and ratio < 1 and c.stage != 3:
        out.append(
            _err(
                "zero_optimization.offload_optimizer.ratio",
                f"{ratio} < 1 (partial offload) needs stage 3, stage is {c.stage}; set ratio 1 or stage 3",
            )
        )
    for which, dev in (("offload_optimizer", odev), ("offload_param", pdev)):
        if dev != "nvme" or (which == "offload_param" and c.stage != 3):
            continue
        key = f"zero_optimization.{which}.nvme_path"
        nvme = c.zero[which].get("nvme_path")
        if not nvme:
            out.append(_err(key, "device is nvme but nvme_path is not set"))
        elif not Path(nvme).is_dir():
            out.append(
                _err(
                    key, f"{nvme} does not exist on this machine; create it or pass --nvme-path to gen-config"
                )
            )
        elif not os.access(nvme, os.W_OK | os.X_OK):
            out.append(
                _err(key, f"{nvme} is not writable; fix its permissions or pass --nvme-path to gen-config")
            )
    return out


def rule_precision(c: Ctx) -> list[Finding]:
    on = {k: isinstance(c.raw.get(k), dict) and c.raw[k].get("enabled") is True for k in ("fp16", "bf16")}
    if all(on.values()):
        return [
            _err(
                "fp16.enabled",
                "fp16 and bf16 are both enabled; DeepSpeed refuses this. Enable one, "
                'or set both to "auto" and let the training config choose',
            )
        ]
    autocast = isinstance(c.raw.get("torch_autocast"), dict) and c.raw["torch_autocast"].get("enabled") is True
    mode = next((k for k, v in on.items() if v), None)
    if autocast and mode:
        return [
            _warn(
                "torch_autocast.enabled",
                f"torch_autocast together with {mode}.enabled: DeepSpeed casts the whole model to {mode} "
                "and autocasts as well; pick one (torch_autocast keeps fp32 weights, e.g. LoRA adapters)",
            )
        ]
    return []
