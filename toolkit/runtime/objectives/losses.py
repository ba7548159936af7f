"""Preference losses from per-sequence log-probabilities, as the papers and TRL define them (knob names as TRL's).

Each takes the policy's (and where the objective has one, the reference's) summed log-probabilities of the chosen and
rejected completions, with their token counts, and returns per-pair losses and the usual per-pair metrics: rewards of
chosen and rejected, their margin, and whether the chosen won. Pure torch: testable on CPU against the formulas.

- dpo (Rafailov et al. 2023, TRL loss_type="sigmoid"): -log sigmoid(beta * ((pc - rc) - (pr - rr))), with
  label_smoothing (cDPO) mixing in the flipped preference.
- ipo (Azar et al. 2023, TRL loss_type="ipo"): ((pc - rc) - (pr - rr) - 1 / (2 beta))^2 on length-averaged log-probs.
- simpo (Meng et al. 2024; TRL: CPOConfig(loss_type="simpo", cpo_alpha=0), the paper's recipe, without CPO's NLL
  term): reference-free, length-averaged: -log sigmoid(beta * (avg_c - avg_r) - gamma), gamma = TRL's simpo_gamma.
- reward (a Bradley-Terry reward model, Ouyang et al. 2022; TRL's RewardTrainer): a sequence classifier with one
  output scores each sequence; -log sigmoid(r_chosen - r_rejected), plus center_rewards_coefficient times the mean of
  (r_chosen + r_rejected)^2 (Eisenstein et al. 2023). `reward_loss` takes the scores, not log-probs.
- orpo (Hong et al. 2024, TRL ORPO): reference-free: the chosen completions' NLL (a token-level mean over the batch, as
  TRL's cross-entropy takes it) minus beta (the paper's lambda) times log sigmoid of the log odds ratio of the
  length-averaged probabilities.
- kto (Ethayarajh et al. 2024, TRL KTOTrainer, loss_type="kto"): unpaired rows, each a completion marked desirable or
  not. With r the completion's log-ratio (policy - reference) and z the batch's KL estimate (the mean log-ratio of
  mismatched completions, every rank's, clamped at 0, no gradient): desirable_weight * (1 - sigmoid(beta * (r - z)))
  for a desirable row, undesirable_weight * (1 - sigmoid(beta * (z - r))) for an undesirable one. `kto_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "reward", "kto")
REFERENCE_FREE = ("simpo", "orpo", "reward")


@dataclass
class PairLogps:
    """Summed log-probs of the completion tokens of each pair, and how many tokens each completion has."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def averaged(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


@dataclass
class PairLoss:
    loss: torch.Tensor
    """Per pair."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float()


def pair_loss(objective: str, policy: PairLogps, reference: PairLogps | None, *, beta: float,
              label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PairLoss:
    """The objective's per-pair loss. reference: None for the reference-free objectives (simpo, orpo)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective == "reward":
        raise ValueError("a reward model's loss takes its scores, not log-probs: reward_loss")
    if objective == "kto":
        raise ValueError("kto's rows are unpaired, each with its label: kto_loss")
    if objective in REFERENCE_FREE:
        avg_c, avg_r = policy.averaged()
        if objective == "simpo":
            logits = beta * (avg_c - avg_r) - simpo_gamma
            loss = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
            return PairLoss(loss, beta * avg_c.detach(), beta * avg_r.detach())
        # orpo: log odds = log(p / (1 - p)) of the length-averaged probabilities; log1p(-exp(x)) stays finite for x < 0
        log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c)) - torch.log1p(-torch.exp(avg_r)))
        # per pair -chosen / the batch's mean chosen length: their mean over pairs is the token-level mean NLL
        nll = -policy.chosen / policy.chosen_tokens.float().mean().clamp(min=1)
        loss = nll - beta * F.logsigmoid(log_odds)
        return PairLoss(loss, beta * avg_c.detach(), beta * avg_r.detach())
    if reference is None:
        raise ValueError(f"{objective} needs the reference model's log-probs")
    if objective == "ipo":  # IPO's regression target is on length-averaged log-probs (TRL does the same)
        (pc, pr), (rc, rr) = policy.averaged(), reference.averaged()
        logits = (pc - rc) - (pr - rr)
        loss = (logits - 1 / (2 * beta)) ** 2
    else:
        pc, pr, rc, rr = policy.chosen, policy.rejected, reference.chosen, reference.rejected
        logits = (pc - rc) - (pr - rr)
        loss = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return PairLoss(loss, beta * (pc - rc).detach(), beta * (pr - rr).detach())


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_rewards_coefficient: float = 0.0) -> PairLoss:
    """A Bradley-Terry reward model's per-pair loss from the scores of the chosen and rejected sequences."""
    loss = -F.logsigmoid(chosen - rejected)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    return PairLoss(loss, chosen.detach(), rejected.detach())


def kto_loss(policy: PairLogps, reference: PairLogps, desirable: torch.Tensor, kl: torch.Tensor, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PairLoss:
    """KTO's per-row loss. Each row is one completion (`chosen`) and a mismatched one (`rejected`: another row's
    completion after this row's prompt) whose log-ratio estimates the KL term; `kl` is that estimate over the batch
    (every rank's, clamped at 0, detached: objectives/step.py). `desirable`: the row's label. The rewards returned are
    beta times the completion's log-ratio in both fields; the step weighs them by the labels."""
    ratio = policy.chosen - reference.chosen
    good = desirable.to(ratio.dtype)
    loss = (good * desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
            + (1 - good) * undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    reward = beta * ratio.detach()
    return PairLoss(loss, reward, reward)
