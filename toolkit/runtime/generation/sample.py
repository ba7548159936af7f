"""Sampling seeded per prompt, so a prompt's tokens do not depend on its batch or the world size."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> keeps the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (multiplication wraps modulo 2**64, as it does on CPU and CUDA):
    a counter-based draw, so one kernel per operation gives every row its own stream."""
    z = z + _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


class RowSampler(LogitsProcessor):
    """Temperature, top-p and a draw per row from the row's own stream; generate then runs greedy.

    HF's sampling draws the whole batch from the global RNG at once, so a prompt's tokens change with the
    prompts that share its batch. Here row i's k-th token is argmax(logits_i / T + g) with Gumbel noise
    g = -log(-log u), u a hash of (seeds[i], k, token id): a draw from softmax(logits_i / T) (the Gumbel-max
    trick) that no other row and no batch shape changes, as vLLM's per-request seeds give. The hash is
    computed for the whole batch at once: a torch.Generator per row cost one kernel per row per token.
    Every other token's logit becomes -inf, so the greedy pick is the sampled one.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device: Any) -> None:
        self.seeds = torch.tensor([int(s) & 0x7FFFFFFF for s in seeds], dtype=torch.int64, device=device) << 32
        self.temperature = temperature
        self.top_p = top_p
        self.device = device
        self.step = 0
        self._ids: torch.Tensor | None = None

    def noise(self, vocab: int) -> torch.Tensor:
        """Gumbel noise [rows, vocab] for this decoding step (a pure function of seed, step and token id)."""
        if self._ids is None or self._ids.numel() != vocab:
            self._ids = torch.arange(vocab, device=self.device, dtype=torch.int64) * _signed(GOLDEN)
        base = splitmix64(self.seeds | self.step)  # a key per (seed, step), on the device: no copy a token
        z = splitmix64(base[:, None] + self._ids[None, :])
        u = (_shr(z, 40).float() + 0.5) * 2.0 ** -24  # 24 random bits, in (0, 1)
        return -torch.log(-torch.log(u))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature
        if self.top_p < 1.0:
            logits = top_p_filter(logits, self.top_p)
        choice = (logits + self.noise(logits.shape[-1])).argmax(-1, keepdim=True)
        self.step += 1
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
