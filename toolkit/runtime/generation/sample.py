"""Sampling seeded per prompt, so a prompt's tokens do not depend on its batch or the world size."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor


class RowSampler(LogitsProcessor):
    """Temperature, top-p and a draw per row from the row's own generator; generate then runs greedy.

    HF's sampling draws the whole batch from the global RNG at once, so a prompt's tokens change with the
    prompts that share its batch. Here row i's token is argmax(p_i / q_i) with q_i ~ Exp(1) from a generator
    seeded with seeds[i] (the exponential race: a draw from p_i, as vLLM's per-request seeds do), and every
    other token's logit becomes -inf, so the greedy pick is the sampled one.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device: Any) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature
        if self.top_p < 1.0:
            logits = top_p_filter(logits, self.top_p)
        probs = logits.softmax(-1)
        noise = torch.stack(
            [torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g) for g in self.generators]
        )
        choice = (probs / noise).argmax(-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter_(1, choice, 0.0)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass reaches top_p (the first always), the rest -inf."""
    ordered, idx = logits.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    return logits.scatter(-1, idx, ordered.masked_fill(drop, float("-inf")))


def cut(tokens: list[int], stops: set[int]) -> list[int]:
    """New tokens up to and including the first stop token (the pad tokens after it dropped)."""
    for k, t in enumerate(tokens):
        if t in stops:
            return tokens[: k + 1]
    return tokens
