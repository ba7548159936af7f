"""Bad numbers stop the run early: a NaN/Inf loss or gradient norm, or an fp16 loss scale that keeps
falling (every step skipped on overflow).

The finiteness check runs on the device every step and is read only where the loop syncs anyway (log
steps), so it costs no host sync; it still names the exact step, the rank and that step's samples.
The gradient norm is global, so a NaN anywhere stops every rank at the same check.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class NonFiniteError(RuntimeError):
    """Training produced NaN/Inf, or fp16 overflowed step after step."""


class NonFiniteGuard:
    def __init__(self, device: torch.device, rank: int, fp16: bool, max_skipped_steps: int) -> None:
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)
        self.rank, self.fp16, self.max_skipped = rank, fp16, max_skipped_steps
        self.samples: dict[int, list[int]] = {}
        self.skipped_in_a_row = 0
        self._skipped_before = 0

    def observe(self, step: int, loss: torch.Tensor, grad_norm: Any, samples: list[int], skipped_steps: int) -> None:
        """After each optimizer step; no host sync."""
        finite = torch.isfinite(loss)
        # Under fp16 an overflow is DeepSpeed's to handle (the step is skipped, the scale lowered):
        # there the norm is inf by design, and only a run of skipped steps is a failure.
        if not self.fp16 and isinstance(grad_norm, torch.Tensor):
            finite = finite & torch.isfinite(grad_norm)
        elif not self.fp16 and grad_norm is not None and not math.isfinite(float(grad_norm)):
            finite = torch.zeros_like(finite)
        self.first_bad = torch.where((self.first_bad == 0) & ~finite, step, self.first_bad)
        self.samples[step] = samples
        skipped = skipped_steps - self._skipped_before
        self._skipped_before = skipped_steps
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.fp16 and self.skipped_in_a_row > self.max_skipped:
            raise NonFiniteError(
                f"rank {self.rank}: fp16 overflowed {self.skipped_in_a_row} optimizer steps in a row up to step "
                f"{step}, so the loss scale keeps falling and nothing trains; use bf16 where the GPU has it "
                "(train.precision=bf16), or lower train.lr (train.max_skipped_steps sets this limit)")

    def check(self) -> None:
        """On log steps (the loop syncs there anyway): raise for the first non-finite step."""
        bad = int(self.first_bad)
        if bad:
            raise NonFiniteError(
                f"rank {self.rank}: loss or gradient norm is NaN/Inf at step {bad} "
                f"(this rank's samples in that step: {self.samples.get(bad)}); lower train.lr, check the data "
                "at those indices, or raise train.warmup_steps")
        self.samples.clear()
