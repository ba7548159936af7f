"""GRPO's arithmetic: group-normalized advantages and the clipped policy-ratio loss over completion tokens, with the
token-level variants TRL names (loss_type) and its KL estimator. Pure tensor functions (tests/unit/test_rl.py holds
them against the formulas written out per sequence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.config.schema import LOSS_TYPES


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std of the values that are not NaN (0 where fewer than two are)."""
    n = (~x.isnan()).sum(dim=dim) if dim is not None else (~x.isnan()).sum()
    mean = x.nanmean(dim=dim, keepdim=dim is not None) if dim is not None else x.nanmean()
    sq = ((x - mean) ** 2).nansum(dim=dim) if dim is not None else ((x - mean) ** 2).nansum()
    return torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))


def advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, per-group reward std) of rewards [prompts x group], each prompt's completions consecutive:
    reward minus its group's mean, divided by the group's std (scale=group), the whole step's (batch: `batch_std`,
    over every rank; these rewards' own where not given) or not at all (none), as TRL's scale_rewards; std + 1e-4 as
    TRL, so a group whose rewards are all equal gets advantages 0, not NaN. A NaN reward (a completion no function
    scored) is left out of its group's mean and std and gets advantage 0, as in TRL."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1) if group > 1 else torch.zeros(grouped.shape[0], dtype=rewards.dtype)
    if scale == "group":
        centred = centred / (std[:, None] + 1e-4)
    elif scale == "batch":
        std_all = batch_std if batch_std is not None else float(_nanstd(rewards))
        centred = centred / (std_all + 1e-4)
    return torch.nan_to_num(centred.reshape(-1), nan=0.0), torch.nan_to_num(std, nan=0.0)


@dataclass
class TokenLoss:
    """One micro-batch's loss and what a log line reports of it (sums over its completion tokens)."""

    loss: torch.Tensor
    kl_sum: torch.Tensor
    clipped: torch.Tensor
    tokens: int


def token_loss(logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, seq: torch.Tensor,
               adv: torch.Tensor, *, n_seqs: int, epsilon: float, epsilon_high: float, beta: float, loss_type: str,
               max_completion_length: int, normalizer: float | None = None) -> TokenLoss:
    """The GRPO loss of one micro-batch from its completion tokens (1-D, one entry a token):
    logps (the policy's, with gradients), old (at rollout: the same values detached when each rollout is trained on
    once), ref (the reference's, or None when beta is 0), seq (each token's sequence, 0..n_seqs-1) and adv (each
    sequence's advantage).

    per token: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta KL, r = exp(logps - old), KL = exp(ref - logps)
    - (ref - logps) - 1 (k3, as TRL); then grpo: each sequence's mean, averaged over sequences; bnpo: the mean over the
    micro-batch's tokens; dr_grpo: the sum over n_seqs x max_completion_length; dapo: the sum over `normalizer` (the
    completion tokens of the whole step over all ranks, divided by their number, as TRL's num_items_in_batch)."""
    ratio = torch.exp(logps - old)
    a = adv[seq]
    low, high = ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * a
    per_token = -torch.min(low, high)
    kl_sum = torch.zeros((), device=logps.device)
    if ref is not None and beta:
        d = ref - logps
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
        kl_sum = kl.detach().sum()
    clipped = (high < low).float().sum().detach()
    tokens = int(logps.numel())
    if loss_type == "grpo":
        lengths = torch.zeros(n_seqs, device=logps.device, dtype=per_token.dtype).index_add(0, seq, torch.ones_like(per_token))
        per_seq = torch.zeros(n_seqs, device=logps.device, dtype=per_token.dtype).index_add(0, seq, per_token)
        loss = (per_seq / lengths.clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / max(tokens, 1)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (n_seqs * max_completion_length)
    elif loss_type == "dapo":
        if not normalizer:
            raise ValueError("loss_type=dapo needs the step's completion tokens per rank (normalizer)")
        loss = per_token.sum() / normalizer
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    return TokenLoss(loss, kl_sum, clipped, tokens)
