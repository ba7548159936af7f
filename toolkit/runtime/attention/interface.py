"""The toolkit's attention for causal LMs, registered with transformers' attention interface.

Two names, one attention function:
- `PACKED`: packed rows from the toolkit's collator, which carry their documents' boundaries
  (`cu_seq_lens_q/k`, `max_length_q/k`, the keywords transformers' own flash-attention path reads), go
  to variable-length attention: each document attends within itself. The name has no mask function, so
  transformers builds no mask for such a batch and does not look for packed sequences in the position
  ids either (`masking_utils._preprocess_mask_arguments`: a host sync every forward, `.all()` on the device).
- `NAME`: every other batch (unpadded rows, padded eval batches, generation, packed rows from someone
  else's collator) goes to transformers' sdpa function with transformers' sdpa mask, so it computes what
  `attn_implementation="sdpa"` computes. Unpadded rows of a sliding-window model carry boundaries instead, each
  row one document (runtime/attention.plan), and run under `PACKED`: its sliding layers through the kernel's window.
A pre-hook on the model picks the name for each forward from its keyword arguments (`watch_boundaries`).
Within a packed batch, rows that hold one document (`whole_rows`, from the collator) go to sdpa's causal
kernel instead: at 8k tokens cuDNN's causal kernel is about 1.5x faster per token than flash's varlen one
(bench/results/real_data.md), and such rows are common once long documents are cut into rows.

Why not plain sdpa with packed rows: transformers builds a (batch, 1, seq, seq) block-diagonal mask for
them every forward, and a masked sdpa call cannot use the flash or cuDNN kernels: 8.16 ms against 3.10 ms
(varlen) for one llama-1b layer at 16 x 2048, fwd + bwd, on an H100 (bench/results/real_data.md).
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.runtime.attention.kernels import varlen

NAME = "toolkit_sdpa"
PACKED = "toolkit_varlen"


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
    # (unpacked rows reach this line only where config/attention.kernel_window found none of the below)
    if dropout and module.training:
        raise ValueError("variable-length attention (packed rows) runs without attention dropout; set the model's "
                         "attention_dropout to 0 or data.packing=false")
    extras = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]  # Gemma-2's softcapping, GPT-OSS's sinks
    if extras or not getattr(module, "is_causal", True):
        what = f"attention with {', '.join(extras)}" if extras else "bidirectional attention"
        raise ValueError(f"packed rows: this model's {what} is not what the varlen kernel computes; "
                         "set model.attn_implementation=eager (packed rows then use a mask) or data.packing=false")
    # the window as the layer's attention hands it, else as it keeps it (Qwen2-MoE and Moshi keep it, not hand it)
    whole = kwargs.get("whole_rows")
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if whole is None or window is not None:  # (sdpa's causal kernel has no window)
        return _varlen(query, key, value, cu, int(kwargs["max_length_q"]), scaling, window), None
    if whole == query.shape[0]:  # every row one document: the whole batch is causal attention
        return _causal(module, query, key, value, scaling), None
    # The first `whole` rows are one document each (the collator put them first), the rest packed: each group
    # through its kernel on a slice of the batch (a view: no gather), the two outputs joined.
    causal = _causal(module, query[:whole], key[:whole], value[:whole], scaling)
    packed = _varlen(query[whole:], key[whole:], value[whole:], kwargs["packed_cu_seq_lens"],
                     int(kwargs["packed_max_length"]), scaling, None)
    return torch.cat([causal, packed]), None


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, longest: int,
            scaling: float | None, window: int | None) -> torch.Tensor:
    """(batch, heads, seq, dim) inputs -> (batch, seq, heads, dim), documents attending within themselves."""
    b, h, s, d = query.shape
    # (batch, heads, seq, dim) -> (batch * seq, heads, dim): one copy, as transformers' flash path makes
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    return varlen(q, k, v, cu, longest, scaling, window).view(b, s, h, d)


def _causal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """Rows that are one document each: transformers' sdpa call without a mask (the causal kernel, kv heads
    passed as transformers passes them), -> (batch, seq, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True)[0]


def _pick_name(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    want = PACKED if kwargs.get("cu_seq_lens_q") is not None else NAME
    if module.config._attn_implementation != want:
        module.config._attn_implementation = want


def register() -> None:
    """Add both names to transformers' attention interface and NAME to its mask interface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(PACKED, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def watch_boundaries(model: torch.nn.Module) -> None:
    """Pre-hooks on every transformers model inside `model` (the LM and its backbone, under LoRA too): each
    forward runs under PACKED when it carries document boundaries, else under NAME."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and not getattr(m, "_toolkit_boundaries", False):
            m.register_forward_pre_hook(_pick_name, with_kwargs=True)
            m._toolkit_boundaries = True
