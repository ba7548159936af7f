"""Positions for long sequences: the long-context presets, model.rope_factor (rope scaling past a model's
positions), and the one line that refuses a sequence beyond them (run and `toolkit plan`)."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.runtime.model import model_config


def test_the_long_presets_have_llama3_scaling_to_131072_positions() -> None:
    for name, factor in (("llama-3.2-1b", 32.0), ("llama-3.1-8b", 8.0)):
        mc = model_config(load_config(None, [f"model.name={name}", "data.seq_len=131072"]))
        rope = mc.rope_parameters
        assert mc.max_position_embeddings == 131072 and rope["rope_type"] == "llama3" and rope["factor"] == factor
        assert rope["original_max_position_embeddings"] == 8192


def test_rope_factor_extends_a_model_without_scaling_through_yarn() -> None:
    mc = model_config(load_config(None, ["model.name=llama-1b", "model.rope_factor=4", "data.seq_len=32768"]))
    assert mc.max_position_embeddings == 32768
    assert mc.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                                  "rope_theta": 500_000.0}


def test_rope_factor_multiplies_a_models_own_scaling() -> None:
    mc = model_config(load_config(None, ["model.name=llama-3.2-1b", "model.rope_factor=2", "data.seq_len=262144"]))
    assert mc.max_position_embeddings == 262144
    assert mc.rope_parameters["rope_type"] == "llama3" and mc.rope_parameters["factor"] == 64.0
    assert mc.rope_parameters["original_max_position_embeddings"] == 8192  # llama3's own, kept


def test_the_extended_model_builds_and_runs_past_its_old_positions() -> None:
    from transformers import LlamaForCausalLM

    cfg = load_config(None, ["model.name=tiny", "model.rope_factor=2", "data.seq_len=1024"])  # tiny: 512 positions
    model = LlamaForCausalLM(model_config(cfg))
    assert model.model.rotary_emb.rope_type == "yarn"
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 1000, (1, 1024)))
    assert torch.isfinite(out.logits).all()


def test_a_sequence_beyond_the_positions_is_one_line_that_says_how_to_extend() -> None:
    with pytest.raises(ConfigError) as e:
        model_config(load_config(None, ["model.name=llama-1b", "data.seq_len=32768"]))
    msg = str(e.value)
    assert "above the model's maximum of 8192 positions" in msg and "model.rope_factor" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"model\.rope_factor must be >= 1"):
        load_config(None, ["model.rope_factor=0.5"])


def test_plan_takes_the_rope_factor(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from toolkit.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpus", "1", "--seq", "32768", "--global-batch", "8", "--lora"]
    assert main(args) == 1
    assert "--rope-factor" in capsys.readouterr().err
    assert main([*args, "--rope-factor", "4", "--json"]) == 0
    assert "--rope-factor 4" in json.loads(capsys.readouterr().out)["command"]
    assert main([*args, "--rope-factor", "4", "-o", str(tmp_path)]) == 0
    assert "rope_factor: 4.0" in (tmp_path / "train.yaml").read_text()  # the run it writes extends the same way
