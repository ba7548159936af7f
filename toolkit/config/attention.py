"""Which sliding-window layers the toolkit's varlen kernel can run with their window, read from a model's config, and
whether transformers runs the model through sdpa at all (has_sdpa: else a run takes eager, and the plan counts it).

Shared by the run (toolkit/runtime/attention: unpacked rows of such a model go to the kernel, each row one document)
and the planner (toolkit/plan/shapes: a sliding layer timed at its window), so the two agree.
"""

from __future__ import annotations

from typing import Any

from toolkit.config.models import text_config

# transformers 5.24 model types whose attention keeps no window of its own to hand the attention function (neither a
# `sliding_window=` keyword nor a `sliding_window` attribute; a scan of their modeling files): their sliding layers
# stay on transformers' mask
NO_WINDOW_KWARG = frozenset({"doge", "phimoe"})


def kernel_window(config: Any) -> int | None:
    """The window of the model's sliding-window layers where the varlen kernel computes what transformers' sliding
    mask does; None where it has no such layers or the kernel cannot take them: attention dropout (the kernel has
    none), Gemma 2's softcapping, bidirectional attention (EmbeddingGemma), attention sinks and every model without an
    sdpa path (gpt-oss, Gemma 2: transformers runs them eager or through flash-attn)."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if (getattr(text, "attention_dropout", 0) or getattr(text, "attn_logit_softcapping", None)
            or getattr(text, "use_bidirectional_attention", False)
            or getattr(text, "model_type", "") in NO_WINDOW_KWARG or not has_sdpa(text)):
        return None
    return int(window)


def sliding_layers(config: Any, layers: int) -> int:
    """How many of the first `layers` decoder layers attend through the window: those `layer_types` lists as sliding
    (transformers 5 fills the list for Gemma, Qwen2, gpt-oss), else every layer (Mistral, Phi-3)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    return sum(t == "sliding_attention" for t in types[:layers]) if types else layers


def has_sdpa(config: Any) -> bool:
    """transformers runs this causal LM's attention through sdpa. Not Gemma 2's (softcapping), gpt-oss's (sinks), nor
    a family's own attention (Reformer's LSH, MPT's, XLNet's): 32 of the 166 types that plan (transformers 5.24), which
    refuse to be built with attn_implementation="sdpa"."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return False
    return bool(getattr(cls, "_supports_sdpa", False))
