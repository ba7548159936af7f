"""model.activation_offload: the decision (auto, pinned or pageable) and the offload context's bookkeeping.

DeepSpeed's context offloads nothing on CPU tensors (`_should_skip`), so here its skip test is narrowed to what a GPU
run skips besides the device (parameters, tensors under 1 KiB): the host-to-host copies then follow the same path as
a GPU's, without streams. What the GPU peak gains is measured in tests/gpu/test_gpu_offload.py and bench/.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.plan.speedups import activation_offload_on, offload_pinned, pinned_bytes
from toolkit.runtime.sequence import offload

GIB = 2**30


def _tiny_llama(layers: int = 3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _offload_on_cpu(ctx: object, monkeypatch: pytest.MonkeyPatch) -> None:
    def skip(tensor: torch.Tensor) -> bool:
        return isinstance(tensor, torch.nn.Parameter) or tensor.element_size() * tensor.nelement() < ctx.min_offload_bytes

    monkeypatch.setattr(ctx, "_should_skip", skip)


def _grads(model: torch.nn.Module, ids: torch.Tensor, ctx: object | None) -> dict[str, torch.Tensor]:
    model.zero_grad()
    if ctx is None:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with ctx:
            model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_inputs_give_the_same_gradients_and_are_released_after_their_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = _tiny_llama(), torch.randint(0, 128, (2, 32))
    plain = _grads(model, ids, None)
    ctx = offload._offload_class()(use_pin_memory=False, use_streams=False)
    _offload_on_cpu(ctx, monkeypatch)
    restored: list[int] = []
    real_restore = ctx._restore_tensor
    monkeypatch.setattr(ctx, "_restore_tensor", lambda i, cache=True: (restored.append(len(ctx._restored)),
                                                                        real_restore(i, cache))[1])
    for _ in range(2):  # the context is entered again per micro-batch; its host buffers are reused
        got = _grads(model, ids, ctx)
        for name, g in plain.items():
            torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    # 3 layers: the newest input stays on the device, the other two went to host buffers and came back once each
    assert (ctx.stats.marked_tensors, ctx.stats.offloaded_tensors, ctx.stats.kept_last_tensors) == (3, 2, 1)
    assert ctx.stats.restored_tensors == 2
    assert max(restored) == 0  # nothing restored is held for the rest of backward


def test_deepspeeds_own_context_holds_every_restored_input_until_it_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why toolkit/runtime/sequence/offload.py subclasses it: if this fails, DeepSpeed releases them itself."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    model, ids = _tiny_llama(), torch.randint(0, 128, (2, 32))
    ctx = CheckpointHiddenStatesOffload(use_pin_memory=False, use_streams=False)
    _offload_on_cpu(ctx, monkeypatch)
    with ctx:
        model(input_ids=ids, labels=ids).loss.backward()
        held = len(ctx._restored)
    assert held == 3  # every layer's input, on the device, until the context exits


def test_auto_offloads_where_the_checkpointed_inputs_take_a_quarter_of_the_gpu() -> None:
    kw = dict(grad_ckpt=True, cuda=True, layers=16, hidden=2048, gpu_bytes=80 * GIB)
    on, why = activation_offload_on("auto", tokens=524288, **kw)  # llama-3.2-1b at 512K: 32 GiB of 80
    assert on and "32.0 GiB per rank, 40% of the GPU" in why
    assert not activation_offload_on("auto", tokens=262144, **kw)[0]  # 16 GiB: 20%
    assert activation_offload_on("true", tokens=1024, **kw)[0]
    assert not activation_offload_on("false", tokens=524288, **kw)[0]
    assert not activation_offload_on("auto", tokens=524288, **{**kw, "grad_ckpt": False})[0]
    off_cpu = activation_offload_on("true", tokens=524288, **{**kw, "cuda": False})
    assert not off_cpu[0] and "CPU" in off_cpu[1]


def test_pinned_buffers_only_where_their_power_of_two_sizes_fit_half_the_host() -> None:
    assert pinned_bytes(3 * GIB) == 4 * GIB and pinned_bytes(2 * GIB) == 2 * GIB
    # llama-3.2-1b at 512K: 16 inputs of 2 GiB, pinned on a 128 GiB host
    assert offload_pinned(layers=16, layer_bytes=2 * GIB, ranks_per_node=1, host_bytes=128 * GIB)[0]
    # Llama-3-8B at 384K: 31 inputs of 3 GiB (the newest stays) would lock 124 GiB: pageable, 93 GiB
    pinned, why = offload_pinned(layers=32, layer_bytes=3 * GIB, ranks_per_node=1, host_bytes=128 * GIB)
    assert not pinned and "93 GiB per node" in why and "lock 124 GiB" in why
    assert offload_pinned(layers=32, layer_bytes=3 * GIB, ranks_per_node=1, host_bytes=None)[0]


def test_the_setting_is_checked_with_the_config() -> None:
    with pytest.raises(ConfigError, match=r"model\.activation_offload must be one of auto, true, pinned, pageable, false"):
        load_config(None, ["model.activation_offload=sometimes"])
    with pytest.raises(ConfigError, match=r"set model\.gradient_checkpointing=true"):
        load_config(None, ["model.activation_offload=true"])
    assert load_config(None, ["model.activation_offload=true", "model.gradient_checkpointing=true"]) \
        .model.activation_offload == "true"


def test_the_plan_says_where_the_inputs_go() -> None:
    p = offload.Plan(True, "model.activation_offload=true: ...", False, "pageable host buffers, 96 GiB per node", 32)
    assert p.describe() == ("checkpointed layer inputs on the CPU: on (model.activation_offload=true: ...; "
                            "pageable host buffers, 96 GiB per node)")
    assert offload.context(offload.Plan(False, "off")).__class__.__name__ == "nullcontext"


def test_the_buffer_pool_keeps_one_per_layer_input_across_batch_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama(layers=4)
    ctx = offload._offload_class()(use_pin_memory=False, use_streams=False, max_fwd_stash_count=0,
                                   max_cpu_buffer_pool_count=4)
    _offload_on_cpu(ctx, monkeypatch)
    for width in (32, 48, 64, 48, 32):  # batches padded to other lengths
        _grads(model, torch.randint(0, 128, (2, width)), ctx)
        assert ctx._cpu_buffer_pool_count <= 4
    # the last length's three offloaded inputs find their buffers in the pool
    assert len(ctx._cpu_buffer_pool.get(((2, 32, 64), torch.float32, torch.strided, False), [])) == 3


def test_plan_with_offload_asked_offers_only_checkpointed_choices(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from toolkit.cli import main

    assert main(["plan", "--model", "llama-3.2-1b", "--gpus", "1", "--seq", "2048", "--global-batch", "8",
                 "--activation-offload", "true", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert rows and all(r["grad_ckpt"] for r in rows)
