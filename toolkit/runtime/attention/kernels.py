"""The attention kernels behind the toolkit's attention function: variable-length attention over packed
documents, and the backend order of sdpa for everything else.

Variable-length attention takes the packed tokens as one (total_tokens, heads, dim) sequence and the
documents' boundaries (`cu_seq_lens`, cumulative offsets, and the longest document): each document
attends only within itself, causally, and no (tokens x tokens) mask is built. On CUDA that is torch's
own `torch.nn.attention.varlen.varlen_attn` (flash attention's varlen kernel, torch 2.10+; no extra
package). Elsewhere a reference runs sdpa once per document: the same function, exact in fp32, for
tests and for the rare CPU run that asks for it (`model.attn_implementation=varlen`).
"""

from __future__ import annotations

import inspect
import itertools
from functools import cache
from typing import Any

import torch

# Measured on one H100 (bench/results/attention.md): which sdpa backend the causal, unpadded case prefers.
# The order is a priority list for torch's dispatcher; a backend that cannot take a call (head size, a
# mask, GQA) is skipped, so the order never changes what is computed, only which kernel computes it.
SDPA_PRIORITY: tuple[str, ...] = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@cache
def _varlen_takes_gqa() -> bool:
    """torch 2.13's varlen_attn repeats kv heads itself (enable_gqa); 2.11's does not."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_available(device: torch.device) -> bool:
    """torch's varlen kernel: CUDA, and a torch that ships it."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor, max_length: int,
           scale: float | None, window: int | None = None) -> torch.Tensor:
    """Causal attention within each document. query (total, heads, dim), key/value (total, kv_heads, dim);
    cu_seq_lens int32 (documents + 1,). window: a sliding window (Mistral), keys at most window - 1 back."""
    left = -1 if window is None else window - 1
    if varlen_available(query.device):
        from torch.nn.attention.varlen import varlen_attn

        n_rep = query.shape[1] // key.shape[1]
        extra: dict[str, Any] = {}
        if n_rep > 1 and _varlen_takes_gqa():
            extra["enable_gqa"] = True
        elif n_rep > 1:
            key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale,
                           window_size=(left, 0), **extra)
    return reference_varlen(query, key, value, cu_seq_lens, scale, left)


def reference_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                     scale: float | None, left: int = -1) -> torch.Tensor:
    """sdpa once per document (any device): what the varlen kernel computes, written plainly."""
    n_rep = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    bounds = cu_seq_lens.tolist()
    for a, b in itertools.pairwise(bounds):
        if b <= a:
            continue
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # (heads, n, dim)
        k, v = k.repeat_interleave(n_rep, dim=0), v.repeat_interleave(n_rep, dim=0)
        mask = None
        if left >= 0:
            i = torch.arange(b - a, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= left)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                             scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def set_sdpa_priority(order: tuple[str, ...] = SDPA_PRIORITY) -> str:
    """Put the measured order of sdpa backends first, process-wide (once, before any compile traces sdpa).
    Returns the first backend's name for the run's first lines."""
    from torch.nn.attention import SDPBackend

    wanted = [int(getattr(SDPBackend, name)) for name in order]
    current = list(torch._C._get_sdp_priority_order())
    torch._C._set_sdp_priority_order(wanted + [b for b in current if b not in wanted])
    return order[0].split("_")[0].lower().replace("cudnn", "cuDNN")
