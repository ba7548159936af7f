"""ZeRO-3 leaf modules: the training run refuses a leaf that holds the input embeddings (its backward
hook never fires, so its parameters would train on no gradient); `toolkit check` warns about the
granularity threshold that picks such leaves. The 2-rank run that is refused: tests/dist/test_train.py."""

from __future__ import annotations

import pytest
from deepspeed.utils import set_z3_leaf_module, set_z3_leaf_modules
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from toolkit.config import ds_config as dc
from toolkit.config.checks import check_config
from toolkit.runtime.model import check_zero3_leaves


def _tiny() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_no_leaves_and_decoder_layer_leaves_pass() -> None:
    model = _tiny()
    assert check_zero3_leaves(model) is None
    set_z3_leaf_modules(model, [LlamaDecoderLayer])  # what DeepSpeed's docs show: inputs carry gradients
    assert check_zero3_leaves(model) is None


@pytest.mark.parametrize("leaf", ["model", "backbone"])
def test_a_leaf_holding_the_embeddings_is_refused(leaf: str) -> None:
    model = _tiny()
    set_z3_leaf_module(model if leaf == "model" else model.model, True)
    msg = check_zero3_leaves(model)
    name = "LlamaForCausalLM" if leaf == "model" else "LlamaModel"
    assert msg is not None and f"leaf module {name} holds the input embeddings" in msg
    assert "stage3_module_granularity_threshold" in msg and "leaf_module" in msg


def test_check_warns_about_the_granularity_threshold_at_stage_3_only() -> None:
    key = "zero_optimization.stage3_module_granularity_threshold"
    z3 = dc.preset("zero3")
    assert key not in {f.key for f in check_config(z3)}
    z3["zero_optimization"]["stage3_module_granularity_threshold"] = 6_000_000
    found = [f for f in check_config(z3) if f.key == key]
    assert [f.level for f in found] == ["warning"] and "gradient norm 0.0" in found[0].message
    z2 = dc.preset("zero2")
    z2["zero_optimization"]["stage3_module_granularity_threshold"] = 6_000_000
    assert [f.message for f in check_config(z2) if f.key == key] == ["stage-3-only setting, ignored at stage 2"]
