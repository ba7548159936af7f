"""What a family keeps in fp32 stays fp32 once the engine exists: checked and recorded, both paths, every stage.

transformers names tensors to keep in fp32 in two class attributes: `_keep_in_fp32_modules_strict` (under bf16 and
fp16) and `_keep_in_fp32_modules` (under fp16). The main case is an MoE router's correction bias
(`e_score_correction_bias`: DeepSeek-V3, GLM-4.5 and others): in bf16 it holds 3-16 distinct values for 256 experts,
and tokens go to other experts. DeepSpeed 0.19.8 keeps such *buffers* in fp32 (`data_types.keep_in_fp32_modules`,
"auto" by default: the model's own lists) and casts every *parameter* to the training dtype, its master in fp32.

So after `deepspeed.initialize`, on every rank, the same pattern DeepSpeed builds (its own `keep_in_fp32_pattern`)
is matched against the module's tensors:
- a named buffer that is not fp32 (a cast after the engine started, an older DeepSpeed, a user's `[]`... where the
  family's strict list says otherwise) stops the run in one line naming it;
- named parameters (e.g. the routers' `gate.weight`) are said and recorded as what DeepSpeed makes of them: the
  training dtype in the forward, fp32 in the optimizer's master (the families named here upcast the router's matmul
  to fp32 in their forward).
The record is fp32_kept.json in the run directory, written only where the family or the config names something.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist

FAULT_ENV = "TOOLKIT_FAULT_CAST_FP32_KEPT"  # tests: the named buffers cast to bf16 after the engine started
SHOWN = 5


@dataclass
class Fp32Report:
    setting: Any  # data_types.keep_in_fp32_modules as the engine got it ("auto" or a list of patterns)
    dtype: str  # the training dtype
    buffers: list[str] = field(default_factory=list)  # named buffers, fp32 as they should be
    params: list[str] = field(default_factory=list)  # named parameters: the training dtype, fp32 masters
    wrong: list[str] = field(default_factory=list)  # named buffers that are not fp32: "name (bfloat16)"

    def line(self) -> str:
        parts = [f"{len(self.buffers)} buffer(s) kept in fp32 ({_names(self.buffers)})"] if self.buffers else []
        if self.params:
            parts.append(f"{len(self.params)} named parameter(s) train in {self.dtype} with fp32 masters, as DeepSpeed "
                         f"keeps buffers only ({_names(self.params)})")
        return "fp32-kept tensors (the family's _keep_in_fp32_modules lists): " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "dtype": self.dtype, "fp32_buffers": self.buffers,
                "params_in_training_dtype": self.params, "not_fp32": self.wrong}


def _names(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def inspect(module: Any, ds: dict[str, Any], dtype: Any) -> Fp32Report | None:
    """The report for `module` (the engine's) trained in `dtype`, or None where nothing is named for fp32."""
    import torch
    from deepspeed.runtime.keep_in_fp32 import KEEP_IN_FP32_AUTO, keep_in_fp32_pattern

    setting = ds.get("data_types", {}).get("keep_in_fp32_modules", KEEP_IN_FP32_AUTO)
    pattern = keep_in_fp32_pattern(module, setting, dtype)
    if pattern is None:
        return None
    report = Fp32Report(setting, str(dtype).removeprefix("torch."))
    for prefix, owner in module.named_modules():
        for name, buf in owner.named_buffers(prefix=prefix, recurse=False):
            if buf is None or not buf.is_floating_point() or not pattern.search(name):
                continue
            if buf.dtype == torch.float32:
                report.buffers.append(name)
            else:
                report.wrong.append(f"{name} ({str(buf.dtype).removeprefix('torch.')})")
    report.params = [n for n, _ in module.named_parameters() if pattern.search(n)]
    return report


def check(run_dir: Path, module: Any, ds: dict[str, Any], precision: str) -> Fp32Report | None:
    """Every rank, right after deepspeed.initialize: raise ConfigError on a named buffer that is not fp32; rank 0
    says the line and writes fp32_kept.json."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if os.environ.get(FAULT_ENV):
        _inject(module, ds, dtype)
    report = inspect(module, ds, dtype)
    if report is None:
        return None
    if dist.rank() == 0:
        from toolkit.runtime.faults.checkpoint import atomic_write

        atomic_write(run_dir / "fp32_kept.json", json.dumps(report.to_dict(), indent=1) + "\n")
    if report.wrong:
        raise ConfigError(f"{len(report.wrong)} buffer(s) the family keeps in fp32 are not fp32 once the engine "
                          f"started: {_names(report.wrong)}; in {report.dtype} they lose the precision the model "
                          "needs (an MoE router's bias sends tokens to other experts). Keep "
                          "data_types.keep_in_fp32_modules at \"auto\" (DeepSpeed >= 0.19.8) and cast nothing after "
                          "the engine starts")
    if dist.rank() == 0 and (report.buffers or report.params):
        print(report.line(), flush=True)
    return report


def _inject(module: Any, ds: dict[str, Any], dtype: Any) -> None:
    """The fault the check is for: the named buffers cast to the training dtype, as a stray `.to(bf16)` does."""
    import torch
    from deepspeed.runtime.keep_in_fp32 import buffers_to_keep_in_fp32, keep_in_fp32_pattern

    pattern = keep_in_fp32_pattern(module, ds.get("data_types", {}).get("keep_in_fp32_modules", "auto"),
                                   dtype if dtype != torch.float32 else torch.bfloat16)
    for buf in buffers_to_keep_in_fp32(module, pattern) if pattern is not None else []:
        buf.data = buf.data.to(torch.bfloat16)
