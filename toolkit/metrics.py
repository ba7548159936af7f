"""Throughput and loss: a rank-0 progress bar and run_dir/metrics.jsonl, the same for both paths."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit import dist


class TokenCounter:
    """Counts the real (non-pad) tokens and the samples this rank trains on.

    The token sum stays a tensor on the batch's device: reading it (`tokens`) synchronizes, so it is
    read on log steps only, never per micro-batch.
    """

    def __init__(self) -> None:
        self._tokens: Any = 0
        self.samples = 0

    def add(self, batch: dict[str, Any]) -> None:
        mask = batch.get("attention_mask")
        if mask is None:  # an unpadded batch (Collator.drop_full_mask): every position is a token
            self._tokens = self._tokens + batch["input_ids"].numel()
            self.samples += int(batch["input_ids"].shape[0])
            return
        self._tokens = self._tokens + mask.sum()
        self.samples += int(mask.shape[0])

    @property
    def tokens(self) -> int:
        return int(self._tokens)


@dataclass
class MetricsLogger:
    run_dir: Path
    total_steps: int
    counter: TokenCounter
    is_main: bool = field(default_factory=lambda: dist.rank() == 0)

    def __post_init__(self) -> None:
        self._t0 = self._last_t = time.perf_counter()
        self._last_tokens = self._last_samples = 0
        self._last_step = 0
        self._bar = None
        if self.is_main:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, desc="train", dynamic_ncols=True, mininterval=0.5)

    def start(self, step: int) -> None:
        """Resume-aware start: step counts and clock from here."""
        self._last_step = step
        self._last_t = time.perf_counter()
        self._last_tokens, self._last_samples = self.counter.tokens, self.counter.samples
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None,
            loss_scale: float | None = None) -> dict[str, Any]:
        """Collective (all ranks call): sums token counts across ranks, rank 0 writes the line.

        With `loss_scale`, `loss` is this rank's value and the line shows sum over ranks x loss_scale,
        reduced in the same all-reduce as the counts (one host sync per log line).
        """
        now = time.perf_counter()
        seen_tokens, seen_samples = self.counter.tokens, self.counter.samples
        tokens, samples, summed = dist.all_reduce_sum([float(seen_tokens - self._last_tokens),
                                                       float(seen_samples - self._last_samples), float(loss)])
        if loss_scale is not None:
            loss = summed * loss_scale
        dt = max(now - self._last_t, 1e-9)
        rec = {"step": step, "loss": loss, "lr": lr,
               "grad_norm": None if grad_norm is None else float(grad_norm),
               "tokens_per_s": tokens / dt, "samples_per_s": samples / dt,
               "step_time_s": dt / max(step - self._last_step, 1), "elapsed_s": now - self._t0}
        self._last_t, self._last_step = now, step
        self._last_tokens, self._last_samples = seen_tokens, seen_samples
        if not self.is_main:
            return rec  # every rank sees the reduced line (first-loss checks decide alike everywhere)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
            self._bar.update(step - self._bar.n)
        return rec

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
