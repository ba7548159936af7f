"""The kernel behind the toolkit's attention function for packed rows: variable-length attention.

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

# sdpa's own backend order is kept: for causal rows without a mask transformers calls sdpa with enable_gqa,
# and that default measured fastest (3.29 ms, one llama-1b layer at 16 x 2048 on an H100, against 3.59 for
# cuDNN and 5.29 for flash with the kv heads repeated; bench/results/real_data.md, attention.json).


GQA = "repeat"
"""How varlen() hands fewer kv heads to the kernel: set once per process by prepare() before any forward (a
plain module value, so a compiled layer reads a constant instead of tracing the probe)."""


def prepare(device: torch.device) -> str:
    """Probe the varlen kernel's GQA support on this device (CUDA) and remember it for varlen(); returns it."""
    global GQA
    if varlen_available(device):
        GQA = gqa_mode(device.index if device.index is not None else torch.cuda.current_device())
    return GQA


@cache
def gqa_mode(device_index: int) -> str:
    """How torch's varlen kernel gets fewer kv heads than query heads: "enable_gqa" (torch 2.13 has the
    flag), "native" (flash attention's kernel takes them as they are; torch 2.11's wrapper passes them
    through), or "repeat" (kv heads repeated first, 4-7x the k/v memory traffic). Probed once per device
    on a small input, forward and backward, against the repeated result."""
    from torch.nn.attention.varlen import varlen_attn

    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return "enable_gqa"
    dev = torch.device("cuda", device_index)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(64, 4, 64, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(64, 2, 64, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 40, 64], device=dev, dtype=torch.int32)
    try:
        native = varlen_attn(q, k, v, cu, cu, 40, 40, window_size=(-1, 0))
        native.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        rep = varlen_attn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cu, 40, 40, window_size=(-1, 0))
        rep.sum().backward()
    except (RuntimeError, ValueError):
        return "repeat"
    same = torch.allclose(native, rep, atol=1e-2) and all(
        torch.allclose(a, t.grad, atol=5e-2) for a, t in zip(grads, (q, k, v), strict=True))
    return "native" if same else "repeat"


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
        if n_rep > 1 and GQA == "enable_gqa":
            extra["enable_gqa"] = True
        elif n_rep > 1 and GQA == "repeat":
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
