"""The toolkit's attention for causal LMs, registered with transformers' attention interface.

One name (`NAME`) serves every batch a run sees:
- packed rows from the toolkit's collator carry their documents' boundaries (`cu_seq_lens_q/k`,
  `max_length_q/k`, the keywords transformers' own flash-attention path reads) and go to variable-length
  attention: each document attends within itself and no 4-D mask is built;
- anything else (unpadded rows, padded eval batches, generation) goes to transformers' sdpa function with
  the mask transformers builds for sdpa, so it computes what `attn_implementation="sdpa"` computes.

Why not plain sdpa with packed rows: transformers builds a (batch, 1, seq, seq) block-diagonal mask for
them every forward, and a masked sdpa call cannot use the flash or cuDNN kernels: 7.76 ms against 2.88
ms for varlen, one llama-1b layer at 16 x 2048 on an H100 (../shared/anchors.md).

The mask function sees no keyword arguments, so a pre-hook on the model records whether this forward
carries boundaries: a packed batch without them (someone else's collator) still gets the real
block-diagonal mask, never a causal mask over several documents.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from toolkit.runtime.attention.kernels import varlen

NAME = "toolkit_varlen"
_forward = threading.local()  # this thread's current forward: does it carry document boundaries?


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, seq, dim), key/value (batch, kv_heads, seq, dim);
    returns (batch, seq, heads, dim) and no weights."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("variable-length attention runs without attention dropout; set the model's "
                         "attention_dropout to 0 or data.packing=false")
    b, h, s, d = query.shape
    # (batch, heads, seq, dim) -> (batch * seq, heads, dim): one copy, as transformers' flash path makes
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    out = varlen(q, k, v, cu, int(kwargs["max_length_q"]), scaling, kwargs.get("sliding_window"))
    return out.view(b, s, h, d), None


def mask_function(**kw: Any) -> torch.Tensor | None:
    """transformers' sdpa mask, except where no mask is needed: no padding and either plain causal rows
    (sdpa's causal kernel) or packed rows whose boundaries reach the attention."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if kw.get("attention_mask") is None and (kw.get("mask_function") is causal_mask_function
                                             or getattr(_forward, "boundaries", False)):
        return None
    return sdpa_mask(**kw)


def _note_boundaries(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _forward.boundaries = kwargs.get("cu_seq_lens_q") is not None


def register() -> None:
    """Add NAME to transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)


def watch_boundaries(model: torch.nn.Module) -> None:
    """Pre-hooks on every transformers model inside `model` (the LM and its backbone, under LoRA too):
    each sees the forward's keyword arguments before the backbone builds its masks."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and not getattr(m, "_toolkit_boundaries", False):
            m.register_forward_pre_hook(_note_boundaries, with_kwargs=True)
            m._toolkit_boundaries = True
