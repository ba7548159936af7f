"""Log-probabilities of the selected tokens from the hidden states and the output embedding, in chunks of tokens:
no [tokens, vocabulary] logits tensor exists whole, in the forward or the backward.

Why by hand: transformers' models build the whole logits tensor, and Liger's fused preference losses chunk over
pairs, not tokens (Liger #439), so at micro-batch 1 (usual under ZeRO-3) a pair's logits peak stays whole
(../shared/notes/preference.md section 3). Here each chunk's logits live only while its log-softmax is taken; the
backward recomputes them chunk by chunk (one more head matmul per chunk, as Liger's fused loss pays).

The output embedding is read outside its module's forward, in the forward and again in the backward: under ZeRO-3 a
caller gathers it for both (or declares the read, as speed/kernels.py does for Liger's fused loss). The gradient
into the hidden states is taken in the weight's dtype (bf16 in training), as Liger's fused loss takes it.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE = -100
# tokens per chunk: about 1 GiB of fp32 logits for a 128K vocabulary at 2,048
DEFAULT_CHUNK = 2048


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
                ) -> torch.Tensor:
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        index = labels.clamp(min=0)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s:s + chunk] @ weight.t()).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            out[s:s + chunk] = logits.gather(1, index[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
        out = out.masked_fill(labels == IGNORE, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        g = grad.float().masked_fill(labels == IGNORE, 0.0)
        index = labels.clamp(min=0)
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            # d(selected - logsumexp) / d logits = onehot(label) - softmax, times the incoming gradient
            d_logits = -torch.exp((h @ weight.t()).float() - lse[s:s + ctx.chunk, None]) * g[s:s + ctx.chunk, None]
            d_logits.scatter_add_(1, index[s:s + ctx.chunk, None], g[s:s + ctx.chunk, None])
            if d_hidden is not None:
                d_hidden[s:s + ctx.chunk] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if d_weight is not None:
                d_weight += d_logits.t() @ h.float()
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None


def selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """log p(labels[t] | hidden[t]) per token (0 where labels is IGNORE). hidden: [tokens, hidden size] (the states that
    predict each label, already aligned with it), weight: the output embedding [vocabulary, hidden size], labels:
    integer token ids [tokens]."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden states for {hidden.shape[0]} tokens, labels for {labels.shape[0]}")
    return _SelectedLogprobs.apply(hidden, weight, labels.long(), max(1, int(chunk)))
