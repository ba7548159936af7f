"""Liger kernels (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) on CUDA, on by default.

Peers expose them as a flag (HF `use_liger_kernel`, Axolotl, LLaMA-Factory); the toolkit turns them on
for every model family Liger supports, on both paths and under LoRA, and says what it did. They are
applied to the built instance, after LoRA and before `deepspeed.initialize`, the way HF Trainer does
(`transformers.integrations.liger`): that creates no parameters, so ZeRO-3's hooks see the patched
modules.

Under ZeRO-3 the fused loss reads `lm_head.weight` outside the head's forward. Undeclared, ZeRO-3 answers
that with a blocking all-gather of the (often tied, vocabulary-sized) matrix outside its prefetcher: a
bare loop measured 22.2k vs 29.0k tokens/s per GPU with it (../shared/anchors.md). So the toolkit
declares the read (`register_external_parameter` on the model), and ZeRO-3 fetches the matrix with the
model's forward. Measured on 2 H200s, llama-1b seq 2048 (bench/results/zero3_tuning.md): ZeRO-3 went
from 45.9k (micro 8, no fused loss) to 63.4k tokens/s per GPU (micro 16 with it), 0.97x ZeRO-2, with the
same losses. `model.liger_fused_loss=false` turns it off.

The fused loss's chunks: Liger sizes them for memory (`chunk_mem_const` 1 by default: about vocabulary / hidden chunks
whatever the micro-batch), and each chunk re-reads the head's weight and its gradient, so a large vocabulary pays
that walk at every micro-step (Gemma 3's head: 114.8 ms at 16,384 tokens against 52.8 ms in chunks of 2,048 rows;
toolkit/plan/liger.py). Liger takes `chunk_mem_const` per call but its patched forwards pass none (gpt-oss's passes 8),
so the toolkit wraps Liger's functional entry point once per process with the run's model.liger_chunk_mem_const.

The fused loss's backward without a synchronize: Liger computes the loss's gradients in forward and, in backward, asks
`torch.equal(grad_output, 1.0)` to skip scaling them, which copies a tensor to the GPU and reads the answer back: the
host waits there until the GPU has run the whole forward, and queues nothing of the backward meanwhile. A step whose
host work outlasts its GPU work (small models: many norms and per-tensor hooks a layer) loses the forward's overlap
at every micro-step (Gemma-3-1B on two H200s: 37 ms a step waited there, bench/results/speed_model/narrow/README.md).
The toolkit's backward always scales, with Liger's own in-place kernel: x times 1.0 is x exactly, so the gradients
are the same bits (tests/gpu/test_gpu_loss_chunks.py), and the scaling reads the head's gradient once (under a
millisecond on an H200 for a 262K x 1,152 head).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from toolkit.plan.liger import LigerChoice, loss_chunk_const


def supported_model_types() -> frozenset[str] | None:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # ImportError, or triton failing to load its driver
        return None
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply(model: Any, choice: LigerChoice) -> None:
    """Patch the instance (the PEFT base model under LoRA, as HF's integration does)."""
    if not choice.enabled:
        return
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, **choice.kwargs)
    if choice.kwargs.get("fused_linear_cross_entropy"):
        chunk_fused_loss(choice.chunk_mem_const)
        fused_loss_backward_without_sync()
    if choice.external_head:
        import deepspeed

        # The fused loss reads the head's weight in the model's forward, not the head's; DeepSpeed's
        # documented API for such a read (partition_parameters.py register_external_parameter) makes
        # ZeRO-3 fetch it with the model's parameters instead of a blocking gather on first touch.
        deepspeed.zero.register_external_parameter(base, base.get_output_embeddings().weight)


def chunk_fused_loss(setting: str) -> None:
    """Every later call of Liger's fused linear cross-entropy (the patched models' loss reaches it through
    liger_kernel.transformers.functional, looked up at each call) takes chunk_mem_const from `setting`: an integer as
    it is, auto as toolkit/plan/liger.loss_chunk_const gives it for the call's own tokens, hidden size and vocabulary,
    at least what the caller asks (gpt-oss's forward asks 8). A second call replaces the first's setting. A Liger
    without the argument (before 0.8.5) keeps its own chunks."""
    from liger_kernel.transformers import functional

    current = functional.liger_fused_linear_cross_entropy
    inner = getattr(current, "_toolkit_inner", current)
    if "chunk_mem_const" not in inspect.signature(inner).parameters:
        return

    @functools.wraps(inner)  # Liger's loss filters its kwargs by this signature (loss_utils.LigerForCausalLMLoss)
    def chunked(input: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
        asked = int(kwargs.get("chunk_mem_const") or 1)
        kwargs["chunk_mem_const"] = loss_chunk_const(setting, tokens=int(input.numel() // input.shape[-1]),
                                                     hidden=int(weight.shape[1]), vocab=int(weight.shape[0]),
                                                     floor=asked)
        return inner(input, weight, *args, **kwargs)

    chunked._toolkit_inner = inner  # type: ignore[attr-defined]
    functional.liger_fused_linear_cross_entropy = chunked


def fused_loss_backward_without_sync() -> bool:
    """Liger's fused-loss backward (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5) replaced, once per process,
    by one that scales the gradients by grad_output without first asking the GPU whether it is 1.0 (the module
    docstring says why). True where it is in place; a Liger whose backward or kernel differs from the one this was
    written against keeps its own."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    from liger_kernel.ops.utils import element_mul_kernel

    current = flce.fused_linear_cross_entropy_backward
    if getattr(current, "_toolkit_without_sync", False):
        return True
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError):  # an install without its sources: nothing to check it against
        return False
    params = list(inspect.signature(current).parameters)
    if params != ["grad_output", "grad_input", "grad_weight", "grad_bias"] or "torch.equal" not in source \
            or "X_col_stride" not in getattr(element_mul_kernel, "arg_names", ()):
        return False

    def backward(grad_output: Any, grad_input: Any, grad_weight: Any, grad_bias: Any) -> tuple[Any, Any, Any]:
        # Liger's own scaling, launch for launch, minus the check: in place, with its kernel (torch's in-place ops on
        # these saved tensors trip autograd's version checks)
        block = min(flce.MAX_FUSED_SIZE, flce.triton.next_power_of_2(grad_input.shape[1]))
        warps = 32 if not flce.is_hip() else 16
        for t in (grad_input, grad_weight):
            if t is not None:
                element_mul_kernel[(t.shape[0],)](t, t.stride(-2), grad_output, t.shape[1], BLOCK_SIZE=block,
                                                  X_col_stride=t.stride(-1), num_warps=warps)
        if grad_bias is not None:
            element_mul_kernel[(grad_bias.shape[0],)](grad_bias, grad_bias.stride(-1), grad_output, 1,
                                                      BLOCK_SIZE=block, num_warps=warps)
        return grad_input, grad_weight, grad_bias

    backward._toolkit_without_sync = True  # type: ignore[attr-defined]
    backward._liger = current  # type: ignore[attr-defined]  # Liger's, for tests/gpu to compare against
    flce.fused_linear_cross_entropy_backward = backward
    return True
