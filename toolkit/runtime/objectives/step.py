"""A preference run's micro-batches on the raw path: the reference's log-probs (no gradients), the policy's, the
objective's loss, its backward; and the per-pair metrics a log line carries (TRL's names).

The log-probs come from the model's logits of the whole micro-batch here (as TRL's default); the chunked path from
the hidden states (logprobs.py) is not wired into the loop yet.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from toolkit.config.schema import Config
from toolkit.launch import dist
from toolkit.runtime.data.batches import to_device
from toolkit.runtime.objectives.batch import logits_logps
from toolkit.runtime.objectives.losses import REFERENCE_FREE, PairLogps, pair_loss
from toolkit.runtime.objectives.reference import adapters_off

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def first_loss(objective: str, beta: float) -> float | None:
    """The first step's loss when the policy is its reference (before any update), or None for reference-free ones."""
    if objective == "dpo":
        return math.log(2)
    if objective == "ipo":
        return 1 / (4 * beta * beta)
    return None


class PreferenceStep:
    """Called by the raw loop for each window when train.objective is not sft."""

    def __init__(self, cfg: Config, mode: str | None, reference: Any = None) -> None:
        self.objective, self.pref, self.mode, self.reference = cfg.train.objective, cfg.pref, mode, reference
        self.grad_accum = cfg.train.grad_accum
        self.device = dist.device()
        self._stats = torch.zeros(len(METRICS), device=self.device)
        self._windows = 0

    @staticmethod
    def logps(model: Any, batch: dict[str, torch.Tensor]) -> PairLogps:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        sums, counts = logits_logps(out.logits, batch["labels"])
        n = sums.shape[0] // 2
        return PairLogps(sums[:n], sums[n:], counts[:n], counts[n:])

    def reference_logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> PairLogps | None:
        if self.objective in REFERENCE_FREE:
            return None
        with torch.no_grad():
            if self.mode == "adapter":
                with adapters_off(engine):
                    return self.logps(engine, batch)
            return self.logps(self.reference, batch)

    def forward_backward(self, engine: Any, batches: list[dict[str, torch.Tensor]], loss_sum: torch.Tensor) -> None:
        """Each micro-batch's loss is the mean over its pairs; DeepSpeed divides it by the accumulation steps and
        averages the gradients over ranks: the step's gradient is that of the mean over all its pairs."""
        for b in batches:
            b = to_device(b, self.device)
            ref = self.reference_logps(engine, b)
            policy = self.logps(engine, b)
            out = pair_loss(self.objective, policy, ref, beta=self.pref.beta,
                            label_smoothing=self.pref.label_smoothing, simpo_gamma=self.pref.simpo_gamma)
            loss = out.loss.mean()
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach() / self.grad_accum
            n_tokens_c, n_tokens_r = policy.chosen_tokens.clamp(min=1), policy.rejected_tokens.clamp(min=1)
            self._stats += torch.stack([
                out.chosen_rewards.mean(), out.rejected_rewards.mean(), out.margins.mean(), out.accuracy.mean(),
                (policy.chosen.detach() / n_tokens_c).mean(), (policy.rejected.detach() / n_tokens_r).mean(),
            ]).float() / self.grad_accum
        self._windows += 1

    def take(self) -> dict[str, float]:
        """The metrics since the last log line: means over its windows, micro-batches and ranks (a collective).
        logps/* are per-token means of the completions, so long and short pairs compare."""
        world = dist.world_size()
        stats = dist.all_reduce_tensor(self._stats.clone()) / (max(self._windows, 1) * world)
        self._stats.zero_()
        self._windows = 0
        return {k: float(v) for k, v in zip(METRICS, stats.tolist(), strict=True)}
