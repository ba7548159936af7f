"""Memory of batched generation: the KV cache and the prefill's working set per sequence.

The run's generation (toolkit/runtime/generation/gather.py) sizes its batch and decides whether the whole
model may be gathered with these numbers; the planner can count a rollout batch with the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


STATIC_WIDTH = 64  # eval.generate_cache=static: prompt widths rounded up to this, so few shapes compile
MAX_BATCH = 128  # batch size auto: beyond this a decode step of a 1B model on an H100 stops getting cheaper per token


def kv_bytes_per_token(s: DecodeShape, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes


def bytes_per_sequence(s: DecodeShape, prompt_len: int, new_tokens: int, dtype_bytes: int, cuda: bool) -> int:
    """One sequence of a batch: its KV cache at full length, plus the prefill's largest layer working set
    (the MLP's up/gate outputs and a few hidden-sized tensors), plus the next-token logits in fp32. Off CUDA
    the attention runs as a matmul whose (heads x prompt x prompt) scores exist whole; on CUDA SDPA's fused
    kernels keep none."""
    kv = (prompt_len + new_tokens) * kv_bytes_per_token(s, dtype_bytes)
    work = prompt_len * (2 * s.intermediate + 4 * s.hidden) * dtype_bytes + 2 * s.vocab * 4
    if not cuda:
        work += s.heads * prompt_len * prompt_len * 4
    return kv + work


def batch_that_fits(budget: int, per_sequence: int, prompts: int, cap: int) -> int:
    """The largest batch whose sequences fit `budget` bytes, at most `cap` and the prompts there are; 0 where
    not even one fits."""
    if per_sequence <= 0:
        return max(1, min(prompts, cap))
    return max(0, min(prompts, cap, budget // per_sequence))
