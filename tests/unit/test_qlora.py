"""QLoRA (model.load_in_4bit, toolkit/runtime/quant; docs/qlora.md): the settings refused in one line, and the base's
Linears swapped for bitsandbytes' 4-bit ones holding the same weights (on the CPU). The 2-rank runs at ZeRO-0, 2 and 3
are in tests/dist/test_train.py's shared launch."""

from __future__ import annotations

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.load_in_4bit=true"], "trains LoRA adapters on a frozen 4-bit base (QLoRA): set lora.enabled=true"),
    (["model.load_in_4bit=true", "lora.enabled=true", "model.bnb_4bit_quant_type=int4"],
     "model.bnb_4bit_quant_type must be nf4 or fp4"),
    (["model.load_in_4bit=true", "lora.enabled=true", "train.precision=fp16"],
     "DeepSpeed's fp16 mode would cast them"),
    (["model.load_in_4bit=true", "lora.enabled=true", "train.objective=grpo"], "rollouts through the 4-bit model"),
])
def test_bad_qlora_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_base_becomes_4bit_linears_with_the_same_weights_and_the_head_stays() -> None:
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.runtime.quant import quantize_4bit

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    assert quantize_4bit(model, dtype=torch.float32, quant_type="nf4", device="cpu") == 14
    q = model.model.layers[0].mlp.down_proj
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.dtype == torch.float32  # packed, stored as fp32
    assert q.weight.numel() * 4 == before.numel() // 2  # 4 bits a weight
    w = dequantize_4bit(q.weight.data, q.weight.quant_state)
    # NF4's rounding (16 levels a block of 64), not other weights: a fresh draw would be off by about 1.4x the mean
    assert (w - before).abs().mean() < 0.15 * before.abs().mean()
    assert type(model.lm_head) is torch.nn.Linear
    x = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(model(input_ids=x).logits).all()
