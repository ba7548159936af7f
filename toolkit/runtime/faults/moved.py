"""Every trainable parameter moves: checked over the first optimizer steps that have a learning rate, both paths.

A parameter that trains on no gradient ends in no error: the optimizer steps on zeros and the loss still falls
through the others. ZeRO-3 leaf hooks that never fire did that to about 390 of 417 parameters of a Qwen3.5 model
(OpenRLHF #1258), and so does a parameter frozen by mistake after the optimizer was built. So each rank takes two
numbers of each trainable parameter's local part of its fp32 master (its ZeRO-3 partition, its fragment at ZeRO-1/2,
or the weight itself at ZeRO-0): the sum and the norm, in fp32 without a copy. It takes them before the first optimizer step whose learning rate is above
zero (warmup starts at 0) and again after the second such step: LoRA's B starts at zero, so A's first gradient is
zero and A first moves at the second step. One all-reduce (MAX) of a changed flag per parameter then says, on every
rank, which parameters did not move.

A parameter that did not move is named in a warning (train.check_moved=warn, the default), or stops the run
(error).
Experts of a Mixture-of-Experts layer that did not move got no tokens in those steps: named as such, never stopped
on. The cost is two reads of the trainable weights and one small all-reduce, once a run (bench/results/faults/).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist

FAULT_ENV = "TOOLKIT_FAULT_ZERO_GRAD"
_EXPERT = re.compile(r"(^|\.)experts\.")
SHOWN = 5


class NotTrainingError(ConfigError):
    """Trainable parameters that did not move: the run would train without them."""


class MoveCheck:
    def __init__(self, model: Any, mode: str) -> None:
        self.mode = mode
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if mode != "off" else []
        self.before: Any = None
        self.steps = 0  # optimizer steps with a learning rate since `before`
        self.done = not self.params
        self._skipped, self._counts = 0, False
        self.spent_s = 0.0  # the check's own time (two fingerprints and the all-reduce), said with its verdict
        fault = os.environ.get(FAULT_ENV)  # tests: one parameter's gradient zeroed, as a hook that never passes it
        for name, p in self.params:
            if fault and name == fault:
                p.register_hook(lambda g: g * 0)

    @staticmethod
    def _local(p: Any) -> Any:
        """This rank's part of the parameter's fp32 master where DeepSpeed keeps one: a bf16 weight may not change
        at all in a step whose update is below its resolution (a small learning rate early in warmup), its master
        does. ZeRO-3: the partition (DeepSpeed's safe_get_local_fp32_param); ZeRO-1/2 and the bf16 optimizer: this
        rank's fragment (an empty one where another rank holds it); else the weight itself (fp32 at ZeRO-0)."""
        import torch

        if hasattr(p, "ds_id"):
            from deepspeed.utils import safe_get_local_fp32_param

            master = safe_get_local_fp32_param(p) if p.requires_grad else None
            return master if master is not None else p.ds_tensor
        if hasattr(p, "_hp_mapping"):
            return p._hp_mapping.get_hp_fragment() if p._hp_mapping is not None else torch.empty(0)
        return p.data

    def _prints(self) -> Any:
        import torch

        rows = []
        for _, p in self.params:
            t = self._local(p).detach()
            if t.numel() == 0:  # a ZeRO-3 partition of a small tensor may be empty on some ranks
                rows.append(torch.zeros(2, dtype=torch.float32, device=t.device))
                continue
            rows.append(torch.stack([torch.sum(t, dtype=torch.float32),
                                     torch.linalg.vector_norm(t, dtype=torch.float32)]))
        # where the all-reduce runs (a master offloaded to the CPU is read where it lives)
        device = dist.device() if torch.distributed.is_available() and torch.distributed.is_initialized() \
            else rows[0].device
        return torch.stack([r.to(device) for r in rows])

    def step_begin(self, engine: Any) -> None:
        """Before an optimizer step (all its micro-batches) of the DeepSpeed engine."""
        if self.done:
            return
        self._skipped = engine.skipped_steps
        self._counts = engine.get_lr()[0] > 0  # the learning rate this step uses (warmup starts at 0)
        if self._counts and self.before is None:
            t0 = time.perf_counter()
            self.before = self._prints()
            self.spent_s += _synced(t0)

    def step_end(self, engine: Any, step: int) -> str | None:
        """After the step: on the second step with a learning rate, the verdict (every rank alike). Raises
        NotTrainingError for parameters that did not move (mode error); returns the line to print, or None."""
        if self.done or not self._counts or engine.skipped_steps != self._skipped:  # fp16 skips overflowed steps
            return None
        self.steps += 1
        if self.steps < 2:
            return None
        import torch

        self.done = True
        t0 = time.perf_counter()
        changed = (self._prints() != self.before).any(dim=1).to(torch.int32)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(changed, op=torch.distributed.ReduceOp.MAX)
        self.spent_s += _synced(t0)
        still = [n for (n, _), c in zip(self.params, changed.tolist(), strict=True) if not c]
        self.before = None
        experts = [n for n in still if _EXPERT.search(n)]
        others = [n for n in still if not _EXPERT.search(n)]
        lines = []
        if experts:
            lines.append(f"note: {len(experts)} expert parameter(s) did not move over steps {step - 1}-{step}: their "
                         f"experts got no tokens there ({_names(experts)})")
        if others:
            line = (f"{len(others)} of {len(self.params)} trainable parameter(s) did not move over optimizer steps "
                    f"{step - 1}-{step}, the first two with a learning rate: they train on no gradient "
                    f"({_names(others)}). Frozen after the optimizer was built, or a ZeRO-3 leaf or hook that never "
                    "passes their gradient" + ("; train.check_moved=warn lets the run go on" if self.mode == "error" else ""))
            if self.mode == "error":
                raise NotTrainingError(line)
            lines.append(f"warning: {line}")
        if not still:
            lines.append(f"every trainable parameter moved over steps {step - 1}-{step} ({len(self.params)} tensors; "
                         f"checked in {self.spent_s * 1e3:.1f} ms)")
        return "; ".join(lines)


def _synced(t0: float) -> float:
    """Seconds since t0, the GPU's queued work included (the check runs once a run: the sync costs nothing)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _names(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
