"""Which models compile their decoder layers as ZeRO-3 leaf modules (toolkit/runtime/compile.py leaves_safe):
a leaf's gradients are reduced in its full backward hook, which torch calls early when no input of the module
needs a gradient, so only models whose input embeddings train qualify."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_full_fine_tune_layers_can_be_leaves() -> None:
    from toolkit.runtime.compile import leaves_safe

    assert leaves_safe(_tiny())


def test_frozen_embeddings_and_lora_keep_hooks_per_submodule() -> None:
    from peft import LoraConfig, get_peft_model

    from toolkit.runtime.compile import leaves_safe

    frozen = _tiny()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert not leaves_safe(frozen)
    lora = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not leaves_safe(lora)


def test_plain_linear_is_set_unless_the_user_chose() -> None:
    from toolkit.runtime.compile import plain_linear

    ds: dict = {"zero_optimization": {"stage": 3}}
    assert plain_linear(ds) is None and ds["zero_optimization"]["memory_efficient_linear"] is False
    mine = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
    note = plain_linear(mine)
    assert note and "memory_efficient_linear=true" in note and mine["zero_optimization"]["memory_efficient_linear"]
