"""Attention for training: which implementation a run uses, and the kernels behind the toolkit's own.

- `plan(...)` decides (toolkit/runtime/resolved.py calls it, once per run) the `attn_implementation` the model is built with and whether the
  collator hands packed rows' document boundaries to the model (`AttentionPlan`), and says so in one line.
- `interface.py` is the toolkit's attention function (variable-length for packed rows, sdpa otherwise),
  registered with transformers' attention interface so both training paths and every family that
  supports sdpa use it unchanged.
- `kernels.py` holds the kernels: torch's varlen flash kernel on CUDA, a per-document reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionPlan:
    implementation: str
    """What the model is built with: sdpa, eager, flash_attention_2, or interface.NAME."""
    boundaries: bool
    """Packed batches carry cu_seq_lens_q/k and max_length_q/k (read by the toolkit's and flash-attn's kernels); so do
    unpadded unpacked batches of a sliding-window model, each row one document."""
    note: str
    """The run's line about it."""
    whole_rows: bool = False
    """Batches with boundaries also say which rows hold one document, for the toolkit's attention (`data.row_split`)."""


def sliding_window(config: Any, seq_len: int) -> int | None:
    """The window of the model's sliding-window layers where rows are longer than it (Gemma 3, Mistral) and the varlen
    kernel can take them (config/attention.kernel_window says which). None: no such layer at this length."""
    from toolkit.config.attention import kernel_window

    window = kernel_window(config)
    return window if window is not None and window < seq_len else None


def plan(attn: str, task: str, packing: bool, cuda: bool, varlen_ok: bool, sequence_parallel: int = 1,
         window: int | None = None, sdpa: bool = True) -> AttentionPlan:
    """attn: model.attn_implementation (eager, sdpa, varlen, flash_attention_2); varlen_ok: torch's varlen
    kernel is there (CUDA, torch 2.10+); window: `sliding_window(...)` of the model at the run's length; sdpa:
    transformers runs the model through sdpa (config/attention.has_sdpa): where not, sdpa and varlen mean eager, as
    the toolkit's own attention computes sdpa's (without Gemma 2's softcapping or gpt-oss's sinks)."""
    from toolkit.runtime.attention.interface import NAME

    if not sdpa and task == "causal_lm" and sequence_parallel > 1:
        from toolkit.config.ds_config import ConfigError

        raise ConfigError("train.sequence_parallel runs the toolkit's attention, which computes sdpa's; transformers "
                          "has no sdpa path for this model (softcapping, attention sinks or its own attention), so its "
                          "ranks would attend wrongly: set train.sequence_parallel=1")
    if not sdpa and task == "causal_lm" and attn in ("sdpa", "varlen"):
        mask = "; packed rows use a block-diagonal mask" if packing else ""
        return AttentionPlan("eager", False, f"attention: eager (model.attn_implementation={attn}, but transformers "
                                             "has no sdpa path for this model: softcapping, attention sinks or its "
                                             "own attention; model.attn_implementation=flash_attention_2 runs "
                                             f"flash-attn where the model supports it){mask}")

    if sequence_parallel > 1:  # Ulysses wraps the toolkit's attention (sequence/ulysses.py); eager is refused
        kernel = "torch varlen_attn" if cuda and varlen_ok else "the per-document reference"
        return AttentionPlan(NAME, True, f"attention: Ulysses sequence parallelism over {sequence_parallel} ranks "
                                         f"around the toolkit's attention (sdpa's causal kernel for rows of one "
                                         f"document, {kernel} for packed rows)", whole_rows=True)

    if task != "causal_lm" or attn == "eager":
        built = "sdpa" if attn == "varlen" else attn  # varlen is for causal LMs; others read sdpa as asked
        why = "eager attention" if attn == "eager" else f"{built} ({task})"
        mask = "; packed rows use a block-diagonal mask" if packing else ""
        return AttentionPlan(built, False, f"attention: {why}{mask}")
    if attn == "flash_attention_2":
        how = "; packed rows through its varlen kernel" if packing else ""
        return AttentionPlan(attn, packing, f"attention: flash_attention_2 (flash-attn package){how}")
    if not packing and window and attn in ("sdpa", "varlen") and cuda and varlen_ok:
        # transformers gives a sliding-window layer a boolean mask, and a masked sdpa call runs neither flash's nor
        # cuDNN's causal kernel: 180 against 660-800 TFLOP/s a layer at 4K on an H200, head dim 256
        # (bench/results/speed_model/attention_rates_h200.json). Each unpadded row goes as one document instead.
        return AttentionPlan(NAME, True, f"attention: rows are not packed; the sliding-window layers (window "
                                         f"{window:,}) through torch varlen_attn with its window, each unpadded row "
                                         "one document; the other layers and padded batches through sdpa",
                             whole_rows=True)
    if not packing:
        return AttentionPlan("sdpa", False, "attention: sdpa (causal kernel; rows are not packed)")
    if attn == "varlen" or (cuda and varlen_ok):
        kernel = "torch varlen_attn (flash)" if cuda and varlen_ok else "sdpa once per document (reference, not CUDA)"
        return AttentionPlan(NAME, True, f"attention: packed documents through variable-length attention, {kernel}; "
                                         "rows of one document and other batches through sdpa", whole_rows=True)
    why = "not CUDA" if not cuda else "this torch has no torch.nn.attention.varlen (2.10+)"
    return AttentionPlan("sdpa", False, f"attention: sdpa; packed rows use a block-diagonal mask ({why})")


def install(p: AttentionPlan, cuda: bool) -> str | None:
    """Register the toolkit's attention where the run's plan uses it (toolkit/runtime/resolved.py decided the plan);
    returns how the varlen kernel takes grouped kv heads on this GPU, or None."""
    from toolkit.launch import dist
    from toolkit.runtime.attention.interface import NAME, register
    from toolkit.runtime.attention.kernels import prepare

    if p.implementation != NAME:
        return None
    register()
    return prepare(dist.device()) if p.boundaries and cuda else None
