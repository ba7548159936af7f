"""Log-probabilities of the selected tokens from the hidden states and the output embedding, in chunks of tokens:
no [tokens, vocabulary] logits tensor exists whole, in the forward or the backward.

Why by hand: transformers' models build the whole logits tensor, and Liger's fused preference losses chunk over
pairs, not tokens (Liger #439), so at micro-batch 1 (usual under ZeRO-3) a pair's logits peak stays whole
(../shared/notes/preference.md section 3). Here each chunk's logits live only while its log-softmax is taken; the
backward recomputes them chunk by chunk (one more head matmul per chunk, as Liger's fused loss pays).

The output embedding is read outside its module's forward, in the forward and again in the backward: under ZeRO-3 a
caller gathers it for both (or declares the read, as speed/kernels.py does for Liger's fused loss). The gradients
into the hidden states and the weight are matmuls in the weight's dtype (bf16 in training), as Liger's fused loss
takes them; the weight's is summed over chunks in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from toolkit.config.models import text_config

IGNORE = -100
# config attributes of families whose forward changes the head's output after it (a soft-cap: Gemma 2/3; a scale:
# Cohere, Granite, HyperCLOVA X; a multiplier: Falcon-H1): those take the whole logits
SCALED_HEADS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
# tokens per chunk: about 1 GiB of fp32 logits for a 128K vocabulary at 2,048
DEFAULT_CHUNK = 2048


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                entropy: torch.Tensor | None) -> torch.Tensor:
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        index = labels.clamp(min=0)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s:s + chunk] @ weight.t()).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            out[s:s + chunk] = logits.gather(1, index[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
            if entropy is not None:  # a metric (no gradient): H = logsumexp - sum(p * logits), while the chunk lives
                p = (logits - lse[s:s + chunk, None]).exp_()
                entropy[s:s + chunk] = lse[s:s + chunk] - (p.mul_(logits)).sum(-1)
        out = out.masked_fill(labels == IGNORE, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        g = grad.float().masked_fill(labels == IGNORE, 0.0)
        index = labels.clamp(min=0)
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            # d(selected - logsumexp) / d logits = onehot(label) - softmax, times the incoming gradient; in place,
            # so one fp32 [chunk, vocabulary] buffer lives at a time
            d_logits = (h @ weight.t()).float().sub_(lse[s:s + ctx.chunk, None]).exp_().mul_(-g[s:s + ctx.chunk, None])
            d_logits.scatter_add_(1, index[s:s + ctx.chunk, None], g[s:s + ctx.chunk, None])
            # both matmuls in the weight's dtype (bf16 in training), as Liger's fused loss takes them: an fp32
            # [vocabulary, chunk] x [chunk, hidden] product runs without tensor cores, several times slower
            d_logits = d_logits.to(weight.dtype)
            if d_hidden is not None:
                d_hidden[s:s + ctx.chunk] = (d_logits @ weight).to(hidden.dtype)
            if d_weight is not None:
                d_weight += (d_logits.t() @ h.to(weight.dtype)).float()  # the chunks summed in fp32
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None


def selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      chunk: int = DEFAULT_CHUNK, entropy: torch.Tensor | None = None) -> torch.Tensor:
    """log p(labels[t] | hidden[t]) per token (0 where labels is IGNORE). hidden: [tokens, hidden size] (the states that
    predict each label, already aligned with it), weight: the output embedding [vocabulary, hidden size], labels:
    integer token ids [tokens]. `entropy` (fp32 [tokens], optional) receives each token's entropy of the whole
    distribution, without a gradient."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden states for {hidden.shape[0]} tokens, labels for {labels.shape[0]}")
    return _SelectedLogprobs.apply(hidden, weight, labels.long(), max(1, int(chunk)), entropy)


class SelectedHead:
    """A causal LM whose output head, while `targets(...)` is active, returns each position's log-prob of its next
    label ([rows, positions], fp32) instead of the logits: the model's own forward runs unchanged (its attention,
    Liger's patched forward, DeepSpeed's hooks), and the head's matrix is read inside the head's forward, where
    ZeRO-3 gathers it, and again in its backward, where ZeRO-3 gathers it again. Outside the block the head is
    itself (evaluation, generation).

    None from `of()` for heads that are not a plain matrix product (a final soft-cap or a logit scale): the caller
    falls back to the whole logits."""

    def __init__(self, head: Any, chunk: int = DEFAULT_CHUNK) -> None:
        self.head, self.chunk, self._targets, self._temperature = head, chunk, None, 1.0
        self.entropy: torch.Tensor | None = None
        """After a forward inside `targets(..., entropy=True)`: each position's entropy [rows, positions], fp32."""
        self._want_entropy = False
        plain = head.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if self._targets is None:
                return plain(hidden)
            if self._temperature != 1.0:  # logits / T as (hidden / T) @ W^T: the distribution an RL rollout sampled
                hidden = hidden / self._temperature
            ent = torch.zeros(self._targets.numel(), dtype=torch.float32, device=hidden.device) \
                if self._want_entropy else None
            flat = selected_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight, self._targets.reshape(-1),
                                     self.chunk, ent)
            self.entropy = None if ent is None else ent.view(self._targets.shape)
            return flat.view(self._targets.shape)

        head.forward = forward  # an instance attribute: nn.Module.__call__ (and so every hook) still runs
        head._toolkit_selected = self

    def remove(self) -> None:
        """The head as it was."""
        del self.head.forward, self.head._toolkit_selected

    @staticmethod
    def of(model: Any, chunk: int = DEFAULT_CHUNK) -> SelectedHead | None:
        config = getattr(model, "config", None)
        text = text_config(config)
        if any(getattr(c, k, None) not in (None, 1, 1.0) for c in (config, text) for k in SCALED_HEADS):
            return None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        installed = getattr(head, "_toolkit_selected", None)
        if installed is not None:
            installed.chunk = chunk
            return installed
        return SelectedHead(head, chunk)

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False) -> Iterator[None]:
        """labels: [rows, positions] as a batch carries them; position t's output is log p(labels[t + 1]), of the
        logits divided by `temperature` (an RL run's sampling temperature, as TRL takes its log-probs); `entropy`:
        also each position's entropy, in `self.entropy`."""
        targets = torch.full_like(labels, IGNORE)
        targets[:, :-1] = labels[:, 1:]
        self._targets, self._temperature, self._want_entropy, self.entropy = targets, float(temperature), entropy, None
        try:
            yield
        finally:
            self._targets, self._temperature, self._want_entropy = None, 1.0, False
