"""What a family keeps in fp32 (toolkit/runtime/faults/fp32_kept.py), on a tiny DeepSeek-V3 built in one process:
the routers' `e_score_correction_bias` buffers (its `_keep_in_fp32_modules_strict`) are the case; tests/dist/test_train.py
runs the check through DeepSpeed's engine on both paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.faults import fp32_kept


def _deepseek() -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    for name, buf in model.named_buffers():  # what DeepSpeed's engine does under bf16 (its keep_in_fp32 "auto")
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    return model


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def test_the_routers_bias_kept_in_fp32_is_recorded_and_its_weight_said(tmp_path: Path) -> None:
    report = fp32_kept.check(tmp_path, _deepseek(), {}, "bf16")
    assert report is not None and report.buffers == [BIAS] and report.wrong == []
    assert report.params == ["model.layers.1.mlp.gate.weight"]  # "gate.weight": the training dtype, fp32 masters
    assert json.loads((tmp_path / "fp32_kept.json").read_text())["fp32_buffers"] == [BIAS]


def test_a_kept_buffer_cast_to_bf16_stops_the_run_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp32_kept.FAULT_ENV, "1")
    with pytest.raises(ConfigError) as e:
        fp32_kept.check(tmp_path, _deepseek(), {}, "bf16")
    assert str(e.value).startswith(f"1 buffer(s) the family keeps in fp32 are not fp32 once the engine started: {BIAS} "
                                   "(bfloat16)") and "\n" not in str(e.value)


def test_fp32_training_and_families_that_name_nothing_have_no_report(tmp_path: Path) -> None:
    assert fp32_kept.check(tmp_path, _deepseek(), {}, "fp32") is None
    assert fp32_kept.check(tmp_path, torch.nn.Linear(2, 2), {}, "bf16") is None
    assert not (tmp_path / "fp32_kept.json").exists()


def test_a_users_patterns_are_the_ones_checked(tmp_path: Path) -> None:
    """data_types.keep_in_fp32_modules as a list: DeepSpeed keeps those buffers, and the check holds them."""
    report = fp32_kept.inspect(_deepseek(), {"data_types": {"keep_in_fp32_modules": ["rotary_emb.inv_freq"]}},
                               torch.bfloat16)
    assert report is not None and report.buffers == [] and report.params == []
    assert [w.split(" ")[0] for w in report.wrong] == ["model.rotary_emb.inv_freq"]
