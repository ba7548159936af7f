"""Checkpointed layer inputs on the CPU (`model.activation_offload`), through DeepSpeed's offload context.

Gradient checkpointing keeps one (tokens x hidden) tensor per decoder layer between forward and backward: 256 KiB
a token for an 8B Llama, the largest term of the peak from about 256K tokens (../shared/notes/long_context.md
section 6). DeepSpeed 0.19.6+ (`CheckpointHiddenStatesOffload`) marks each HF `GradientCheckpointingLayer`'s
input, copies it to host buffers on a side stream during forward (the newest stays on the GPU: the first backward
needs it at once) and copies it back when backward recomputes that layer. Forward and backward run inside one
context, per micro-batch.

Written here, what DeepSpeed 0.19.8 gets wrong for this use: its unpack hook caches each restored input in a dict
until the context exits (for a second backward through the same graph), so by the end of backward every layer's
input is back on the GPU and the peak only moves from the top layer's backward to the bottom one's. One backward
per forward here: a restored input is used by its layer's recompute and then freed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.launch import dist
from toolkit.plan.planner import CUDA_CONTEXT_GIB
from toolkit.plan.speedups import activation_offload_on, offload_pinned


@dataclass(frozen=True)
class Plan:
    on: bool
    why: str
    pinned: bool = True
    pinned_why: str = ""
    layers: int = 0
    """Decoder layers: the host buffers kept between micro-batches (one per offloaded input)."""

    def describe(self) -> str:
        state = "on" if self.on else "off"
        return f"checkpointed layer inputs on the CPU: {state} ({self.why}" + (f"; {self.pinned_why})" if self.on else ")")


def decide(setting: str, *, grad_ckpt: bool, layers: int, hidden: int, tokens: int, ranks_per_node: int) -> Plan:
    """The run's choice: `activation_offload_on` against this GPU's memory, then pinned or pageable buffers
    against this host's memory (toolkit/plan/speedups.py, which `toolkit plan` also uses)."""
    import torch

    cuda = torch.cuda.is_available()
    gpu = dist.gpu_memory_bytes(int(CUDA_CONTEXT_GIB * 2**30)) if cuda else 0  # a card, as the planner counts one
    on, why = activation_offload_on(setting, grad_ckpt=grad_ckpt, cuda=cuda, layers=layers, hidden=hidden,
                                    tokens=tokens, gpu_bytes=gpu)
    if not on:
        return Plan(False, why)
    pinned, pinned_why = offload_pinned(layers=layers, layer_bytes=2.0 * hidden * tokens,
                                        ranks_per_node=ranks_per_node, host_bytes=host_memory_bytes(), setting=setting)
    return Plan(True, why, pinned, pinned_why, layers)


def host_memory_bytes() -> float | None:
    """This host's memory, or the container's limit where one is set (cgroup v2, then v1); None if unknown."""
    limits = []
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError):
            text = Path(f).read_text().strip()
            if text.isdigit():
                limits.append(float(text))
    with contextlib.suppress(OSError, ValueError):
        limits.append(float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))
    return min(limits) if limits else None


def context(plan: Plan) -> Any:
    """The context to enter around one micro-batch's forward and backward; a no-op when the plan is off. One
    instance per process and buffer kind, entered again each micro-batch (it resets on entry), so its host buffers
    are reused: a pool of one per layer input, whose buffers of another shape (batches padded to another length)
    make room for this one's instead of piling up."""
    if not plan.on:
        return contextlib.nullcontext()
    return _offloader(plan.pinned, max(plan.layers, 1))


_INSTANCES: dict[bool, Any] = {}


def _offloader(pinned: bool, layers: int) -> Any:
    ctx = _INSTANCES.get(pinned)
    if ctx is None:
        # no forward stash: DeepSpeed's default keeps the two newest offloaded inputs on the GPU as well (to skip their
        # copies back at the start of backward), which at 384K tokens of an 8B model is 6 GiB of the peak
        ctx = _INSTANCES[pinned] = _offload_class()(use_pin_memory=pinned, max_fwd_stash_count=0,
                                                    max_cpu_buffer_pool_count=layers)
    return ctx


def _offload_class() -> type:
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        CheckpointHiddenStatesOffload,
        _OffloadedTensorRef,
    )

    class ReleasingOffload(CheckpointHiddenStatesOffload):
        """DeepSpeed's context whose restored inputs are not cached until exit (the module docstring says why), and
        whose full buffer pool drops a buffer of another shape for this one (DeepSpeed's keeps the first buffers it
        pooled and frees the new ones, so after a change of batch length no buffer is reused again)."""

        def _unpack_tensor(self, maybe_ref: Any) -> Any:
            if isinstance(maybe_ref, _OffloadedTensorRef):
                return self._restore_tensor(maybe_ref.tensor_id, cache=False)
            return maybe_ref

        def _pool_cpu_buffer(self, key: Any, tensor: Any) -> None:
            if self._cpu_buffer_pool_count >= self.max_cpu_buffer_pool_count:
                other = next((k for k, buffers in self._cpu_buffer_pool.items() if k != key and buffers), None)
                if other is not None:
                    self._cpu_buffer_pool[other].pop()
                    self._cpu_buffer_pool_count -= 1
            super()._pool_cpu_buffer(key, tensor)

    return ReleasingOffload
