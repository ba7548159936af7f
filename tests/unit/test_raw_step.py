"""The raw loop's forward and backward of a micro-batch (toolkit/runtime/loops/raw.py RawLoop.forward_backward), on a
real transformers model in one process: what stays alive into backward."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import torch

from toolkit.runtime.loops.raw import RawLoop, Window


class _Engine:
    """DeepSpeed's engine as the loop calls it (forward, backward, step), around a real model: backward records
    whether the model's logits were still referenced when it started."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.logits_alive_in_backward, self.steps = model, [], 0
        self.logits: weakref.ref[torch.Tensor] | None = None

    def __call__(self, **batch: Any) -> Any:
        out = self.model(**batch)
        self.logits = weakref.ref(out.logits)
        return out

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        gc.collect()
        self.logits_alive_in_backward.append(self.logits is not None and self.logits() is not None)
        loss.backward()

    def step(self) -> None:
        self.steps += 1


def _loop() -> RawLoop:
    loop = RawLoop.__new__(RawLoop)  # the parts forward_backward reads; the rest needs a launched run
    loop.t = SimpleNamespace(grad_accum=2)
    loop.state = SimpleNamespace(pref=None, aux_coef=0.0)
    loop.p = SimpleNamespace(resolved=SimpleNamespace(activation_offload=SimpleNamespace(on=False)))
    loop.causal, loop.device, loop.loss_mult, loop.load = True, torch.device("cpu"), 1.0, None
    return loop


def test_the_logits_are_freed_before_backward() -> None:
    """Nothing in backward needs the model output's logits ([tokens, vocabulary] in the model's dtype, 2 bytes a
    logit in bf16); kept, they stayed alive through backward: GPT-2 at micro 16 x 1,024 peaked 1.5 GiB higher."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    engine = _Engine(model)
    ids = torch.randint(0, 128, (2, 16))
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids.flip(0), "labels": ids.flip(0)}]
    w = Window(batches, [0, 1], torch.zeros(()), torch.zeros(()))
    _loop().forward_backward(engine, w)
    assert engine.logits_alive_in_backward == [False, False] and engine.steps == 2
    assert float(w.loss) > 0 and all(p.grad is not None for p in model.parameters())
