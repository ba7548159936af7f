"""A preference run's micro-batches, on either path: the reference's log-probs (no gradients, or precomputed), the
policy's, the objective's loss, its backward; and the per-pair metrics a log line carries (TRL's names).

Log-probs come from the hidden states through the output head in chunks of tokens (logprobs.SelectedHead): no
[tokens, vocabulary] logits tensor exists whole, for the policy or the reference. Models whose forward changes the
head's output (logprobs.SCALED_HEADS) take the whole logits instead, a row at a time.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from toolkit.config.schema import Config
from toolkit.launch import dist
from toolkit.runtime.data.batches import to_device
from toolkit.runtime.objectives.batch import sequence_sums, token_logps
from toolkit.runtime.objectives.logprobs import SelectedHead
from toolkit.runtime.objectives.losses import (
    REFERENCE_FREE,
    PairLogps,
    PairLoss,
    kto_loss,
    pair_loss,
    reward_loss,
)
from toolkit.runtime.objectives.reference import adapters_off

# rewards/margins is not summed: it is rewards/chosen minus rewards/rejected (each a mean over its rows)
SUMMED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
KTO_SUMMED = (*SUMMED, "kl")


def first_loss(objective: str, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
               ) -> float | None:
    """The first step's loss when the policy is its reference (before any update), or None for reference-free ones
    (and kto with unequal weights: then it depends on the batch's labels)."""
    if objective == "dpo":
        return math.log(2)
    if objective == "ipo":
        return 1 / (4 * beta * beta)
    if objective == "kto" and desirable_weight == undesirable_weight:
        return 0.5 * desirable_weight  # every log-ratio and the KL estimate are 0: weight * (1 - sigmoid(0))
    return None


def _module(engine_or_model: Any) -> Any:
    return getattr(engine_or_model, "module", engine_or_model)


class PreferenceStep:
    """What a run with train.objective other than sft calls: the raw loop for each window (forward_backward), the
    Trainer's compute_loss for each micro-batch (loss)."""

    def __init__(self, cfg: Config, mode: str | None, policy: Any, reference: Any = None) -> None:
        self.objective, self.pref, self.mode, self.reference = cfg.train.objective, cfg.pref, mode, reference
        self.grad_accum = cfg.train.grad_accum
        self.device = dist.device()
        self.heads = {id(policy): SelectedHead.of(policy)}
        if reference is not None:
            self.heads[id(_module(reference))] = SelectedHead.of(_module(reference))
        # a reward model has scores, not log-probs: its lines carry the rewards only
        self.summed = SUMMED[:3] if self.objective == "reward" else KTO_SUMMED if self.objective == "kto" else SUMMED
        # per metric: the sum of its values over the window's rows and the sum of their weights (kto: a metric of
        # desirable rows weighs those alone)
        self._stats = torch.zeros(2, len(self.summed), device=self.device)
        self.stored: tuple[Any, Any, tuple[str, str]] | None = None
        """pref.reference=precomputed: (run directory, cache directory, (key, model key)) of the values
        (precompute.py)."""
        self.eval_rows: Any = None
        """Held-out pairs (data.eval_source / data.eval_fraction): a precomputed reference covers them too."""
        self.collate: Any = None
        """The run's PairCollator, for the held-out pairs."""

    def prepare(self, engine: Any, rows: Any, collator: Any, sampler: Any, resumed: bool) -> None:
        """Before the first step: a precomputed reference's values attached to the rows (computed, or loaded)."""
        if self.stored is None or self.objective in REFERENCE_FREE:
            return
        from toolkit.runtime.objectives import precompute

        note = precompute.attach(self, engine, rows, collator, sampler, *self.stored, resumed=resumed,
                                 eval_rows=self.eval_rows)
        if dist.rank() == 0:
            print(note, flush=True)

    def logps(self, model: Any, batch: dict[str, Any]) -> PairLogps:
        """Each pair's summed completion log-probs under `model` (an engine or a module)."""
        per_token = token_logps(model, batch, self.heads.get(id(_module(model))))
        return sequence_sums(per_token, batch["labels"], batch["seq_ids"], batch["sequences"])

    @torch.no_grad()
    def reference_logps(self, engine: Any, batch: dict[str, Any]) -> PairLogps | None:
        """The reference's log-probs of the batch, computed (precomputed values come from `stored_logps`);
        None for reference-free objectives."""
        if self.objective in REFERENCE_FREE:
            return None
        if self.mode in ("adapter", "precomputed") and self.reference is None:
            # the policy itself: adapters off for LoRA; a full fine-tune's precompute pass runs before any update
            with adapters_off(engine) if hasattr(_module(engine), "disable_adapter") else contextlib.nullcontext():
                return self.logps(engine, batch)
        return self.logps(self.reference, batch)

    def stored_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """A precomputed reference's sums of the batch's pairs, [pairs, 2] on the device, copied from pinned memory
        without waiting: a copy from pageable memory may wait for the stream, and after the policy's forward that
        wait would leave the GPU idle while the backward is queued."""
        ref = torch.tensor(batch["ref_logps"], dtype=torch.float32)
        if self.device.type == "cuda":
            ref = ref.pin_memory()
        return ref.to(self.device, non_blocking=True)

    def scores(self, model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """A reward model's scores of each pair's chosen and rejected sequence (rows side by side, chosen first)."""
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        scores = out.logits.squeeze(-1).float()
        return scores[0::2], scores[1::2]

    def _pair_loss(self, engine: Any, b: dict[str, Any], real: torch.Tensor | None = None
                   ) -> tuple[PairLoss, PairLogps | None, dict[str, torch.Tensor]]:
        """The objective's per-pair losses of one micro-batch, the policy's log-probs (None for a reward model) and
        what the metrics read besides (kto: the labels and the KL estimate). real: which rows count (evaluation's
        stand-ins do not)."""
        if self.objective == "reward":
            return reward_loss(*self.scores(engine, b), self.pref.center_rewards_coefficient), None, {}
        stored = self.stored_logps(b) if self.mode == "precomputed" else None  # queued before the forward
        ref = None if stored is not None else self.reference_logps(engine, b)
        policy = self.logps(engine, b)
        if stored is not None:
            ref = PairLogps(stored[:, 0], stored[:, 1], policy.chosen_tokens, policy.rejected_tokens)
        if self.objective != "kto":
            return pair_loss(self.objective, policy, ref, beta=self.pref.beta,
                             label_smoothing=self.pref.label_smoothing, simpo_gamma=self.pref.simpo_gamma), policy, {}
        good = torch.tensor(b["kto_labels"], dtype=torch.bool).to(self.device, non_blocking=True)
        kl = self._kl(policy, ref, real)
        out = kto_loss(policy, ref, good, kl, beta=self.pref.beta, desirable_weight=self.pref.desirable_weight,
                       undesirable_weight=self.pref.undesirable_weight)
        return out, policy, {"good": good, "kl": kl}

    @torch.no_grad()
    def _kl(self, policy: PairLogps, ref: PairLogps, real: torch.Tensor | None) -> torch.Tensor:
        """KTO's KL estimate of this micro-batch: the mean log-ratio of the mismatched completions over every rank's
        rows, clamped at 0, without gradient. Summed as two scalars in one all-reduce (TRL gathers per-rank tensors; a
        gather of non-scalar tensors of different sizes is what hangs its users), so a rank without rows adds 0 and
        a batch with none gives 0, not NaN. Every rank runs the same number of micro-batches, so each calls it alike."""
        ratio = (policy.rejected - ref.rejected).double()
        weight = real.double() if real is not None else torch.ones_like(ratio)
        total = dist.all_reduce_tensor(torch.stack([(ratio * weight).sum(), weight.sum()]))
        return (total[0] / total[1].clamp(min=1)).clamp(min=0).float()

    def _per_pair(self, out: PairLoss, policy: PairLogps | None, extra: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log line's summed metrics ([metrics, rows], in self.summed's order) and their weights (kto: the
        desirable rows for the chosen metrics, the undesirable ones for the rejected)."""
        ones = torch.ones_like(out.loss)
        if self.objective == "kto":
            good = extra["good"].to(out.loss.dtype)
            bad = 1 - good
            reward = out.chosen_rewards
            on_side = torch.where(extra["good"], reward > self.pref.beta * extra["kl"],
                                  reward < self.pref.beta * extra["kl"]).to(out.loss.dtype)
            per_token = policy.chosen.detach() / policy.chosen_tokens.clamp(min=1)
            values = [reward, reward, on_side, per_token, per_token, extra["kl"].expand_as(reward)]
            weights = [good, bad, ones, good, bad, ones]
        else:
            values = [out.chosen_rewards, out.rejected_rewards, out.accuracy]
            if policy is not None:
                values += [policy.chosen.detach() / policy.chosen_tokens.clamp(min=1),
                           policy.rejected.detach() / policy.rejected_tokens.clamp(min=1)]
            weights = [ones] * len(values)
        return torch.stack(values).float(), torch.stack(weights).float()

    def _means(self, sums: torch.Tensor, weights: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """Each summed metric's mean over the rows it weighs, and rewards/margins (chosen minus rejected). A metric
        that weighs no row is left out (kto: a window without desirable rows has no rewards/chosen), as TRL does."""
        means, weighed = (sums / weights.clamp(min=1e-12)).tolist(), (weights > 0).tolist()
        got = {f"{prefix}{k}": float(v) for k, v, w in zip(self.summed, means, weighed, strict=True) if w}
        chosen, rejected = got.get(f"{prefix}rewards/chosen"), got.get(f"{prefix}rewards/rejected")
        if chosen is not None and rejected is not None:
            got[f"{prefix}rewards/margins"] = chosen - rejected
        return got

    def loss(self, engine: Any, b: dict[str, Any]) -> torch.Tensor:
        """One micro-batch (on the device): the reference's log-probs, the policy's, the mean of the objective's
        per-pair losses; its metrics are added to the log window's."""
        if self.mode == "precomputed" and "ref_logps" not in b:
            raise RuntimeError("pref.reference=precomputed: a batch without its reference log-probs (prepare() "
                               "did not run)")
        out, policy, extra = self._pair_loss(engine, b)
        values, weights = self._per_pair(out, policy, extra)
        self._stats += torch.stack([(values * weights).sum(1), weights.sum(1)])
        return out.loss.mean()

    def forward_backward(self, engine: Any, batches: list[dict[str, Any]], loss_sum: torch.Tensor) -> None:
        """The raw loop's window. Each micro-batch's loss is the mean over its pairs; DeepSpeed divides it by the
        accumulation steps and averages the gradients over ranks: the step's gradient is that of the mean over all
        its pairs. (The Trainer path calls `loss` from its compute_loss and does the same.)"""
        for b in batches:
            loss = self.loss(engine, to_device(b, self.device))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach() / self.grad_accum

    @torch.no_grad()
    def evaluate(self, engine: Any, rows: Any, micro: int) -> dict[str, Any]:
        """The held-out pairs' loss and TRL's metrics (eval_ prefixed), means over every pair whatever the world size.
        Every rank runs the same number of forwards (a collective under ZeRO-3); a rank past the end runs a stand-in
        that counts nothing."""
        import time

        from toolkit.runtime.data.batches import rank_batches

        t0 = time.perf_counter()
        k = len(self.summed)
        sums = torch.zeros(2 * k + 2, dtype=torch.float64, device=self.device)  # values, weights, loss, pairs
        was_training = engine.training
        engine.eval()
        try:
            for idx in rank_batches(len(rows), micro, dist.rank(), dist.world_size()):
                b = to_device(self.collate([rows[max(i, 0)] for i in idx]), self.device)
                real = torch.tensor([i >= 0 for i in idx], device=self.device, dtype=torch.float64)
                out, policy, extra = self._pair_loss(engine, b, real)
                values, weights = self._per_pair(out, policy, extra)
                weights = weights.double() * real
                sums[:k] += (values.double() * weights).sum(1)
                sums[k:2 * k] += weights.sum(1)
                sums[-2] += out.loss.double() @ real
                sums[-1] += real.sum()
        finally:
            engine.train(was_training)
        total = dist.all_reduce_tensor(sums)
        n = max(float(total[-1]), 1.0)
        return {"eval_loss": float(total[-2]) / n, **self._means(total[:k], total[k:2 * k], "eval_"),
                "eval_pairs": int(total[-1]), "eval_s": time.perf_counter() - t0}

    def take(self) -> dict[str, float]:
        """The metrics since the last log line: means over its rows on every rank (a collective). logps/* are
        per-token means of the completions, so long and short pairs compare. kto: rewards/chosen and logps/chosen
        over the desirable rows, the rejected ones over the undesirable rows, rewards/accuracies the share of rows on
        their label's side of the KL estimate, kl its mean."""
        stats = dist.all_reduce_tensor(self._stats.clone())
        self._stats.zero_()
        return self._means(stats[0], stats[1])
