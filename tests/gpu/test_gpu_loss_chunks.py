"""GPU tier (one GPU): the fused loss's chunks (model.liger_chunk_mem_const, toolkit/runtime/speed/kernels.py).

- A Liger-patched model's loss reaches Liger's fused linear cross-entropy through the toolkit's wrapper, which gives
  it the chunk_mem_const of toolkit/plan/liger.loss_chunk_const for the call's own tokens (recorded from inside).
- Loss and gradients at auto's chunks of 2,048 rows equal those at Liger's own (chunk_mem_const 1) within bf16
  rounding: the same sums in another order.
- The fused loss's backward without Liger's synchronize (kernels.fused_loss_backward_without_sync): no synchronize
  under torch's sync debug mode, where Liger's own raises, and the same gradient bits as Liger's, unscaled and scaled.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu(1)


def _loss_and_grads(setting: str, seen: list[int]) -> tuple[float, dict[str, torch.Tensor]]:
    from liger_kernel.transformers import functional
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from toolkit.plan.liger import LigerChoice
    from toolkit.runtime.speed import kernels

    torch.manual_seed(0)
    # a vocabulary 16x the hidden size: Liger's own chunks are 1/16 of the tokens
    cfg = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, use_cache=False, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    kernels.apply(model, LigerChoice(kwargs={"rope": True, "rms_norm": True, "swiglu": True,
                                             "fused_linear_cross_entropy": True}, chunk_mem_const=setting))
    liger_fn = functional.LigerFusedLinearCrossEntropyFunction

    class Recorded:  # the autograd function as functional.py calls it, chunk_mem_const its last argument
        supports_inner_impl_dispatch = liger_fn.supports_inner_impl_dispatch

        @staticmethod
        def apply(*args):
            seen.append(args[-1])
            return liger_fn.apply(*args)

    functional.LigerFusedLinearCrossEntropyFunction = Recorded
    try:
        ids = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        functional.LigerFusedLinearCrossEntropyFunction = liger_fn
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_the_fused_loss_takes_the_planned_chunks_with_the_same_loss_and_gradients() -> None:
    from toolkit.plan.liger import loss_chunk_const

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    pytest.importorskip("liger_kernel")
    auto_seen: list[int] = []
    one_seen: list[int] = []
    loss_auto, g_auto = _loss_and_grads("auto", auto_seen)
    loss_one, g_one = _loss_and_grads("1", one_seen)
    # 4 x 1,024 tokens, hidden 512, vocabulary 8,192: Liger's own chunks hold 256 rows, auto's 2,048 (8)
    assert auto_seen == [loss_chunk_const("auto", tokens=4096, hidden=512, vocab=8192)] == [8], auto_seen
    assert one_seen == [1], one_seen
    assert abs(loss_auto - loss_one) < 1e-3, (loss_auto, loss_one)
    for name, g in g_auto.items():
        scale = g_one[name].abs().max().item() + 1e-6
        assert (g - g_one[name]).abs().max().item() <= 2e-2 * scale, name


def _liger_loss_grads(scale: float, *, sync_check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    torch.manual_seed(0)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8192, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 8192, (2048,), device="cuda")
    loss = LigerFusedLinearCrossEntropyFunction.apply(x, w, target)[0]
    out = loss * scale if scale != 1.0 else loss
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if sync_check else "default")
    try:
        out.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return x.grad, w.grad


def test_the_fused_loss_backward_runs_without_a_synchronize_and_gives_liger_s_gradients() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    from toolkit.runtime.speed import kernels

    assert kernels.fused_loss_backward_without_sync()
    ours = flce.fused_linear_cross_entropy_backward
    assert ours._toolkit_without_sync and kernels.fused_loss_backward_without_sync()  # once per process
    for scale in (1.0, 0.25):  # a loss as it is, and as DeepSpeed divides it over 4 accumulated micro-steps
        got = _liger_loss_grads(scale, sync_check=True)
        flce.fused_linear_cross_entropy_backward = ours._liger
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):  # Liger's own asks the GPU
                _liger_loss_grads(scale, sync_check=True)
            want = _liger_loss_grads(scale, sync_check=False)
        finally:
            flce.fused_linear_cross_entropy_backward = ours
        for g, h in zip(got, want, strict=True):
            assert torch.equal(g, h), scale
