"""ZeRO-3 leaf modules: the training run refuses a leaf that holds the input embeddings (its backward
hook never fires, so its parameters would train on no gradient); `toolkit check` warns about the
granularity threshold that picks such leaves. The 2-rank run that is refused: tests/dist/test_train.py. auto resolves
leaves as the plan counts them, in the record `toolkit check --explain --gpu-mem` prints for the GPU nodes."""

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


@pytest.mark.parametrize("model,leaves", [("llama-3-70b", False), ("llama-1b", True)])
def test_a_default_run_takes_leaves_only_where_its_plan_does(model: str, leaves: bool,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 60: on 4 nodes of 8 x 80 GiB with checkpointing, train.zero3_leaves=auto resolves, in the record a login
    node prints for the GPU nodes (`toolkit check --explain --gpu-mem 80`), as `toolkit plan` counts it: a 70B's
    leaves would keep 131 GiB gathered, so hooks (and it plans), a 1B's 2.3 GiB, so leaves."""
    import json

    from toolkit.cli import main
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import preset_shape

    assert main(["plan", "--model", model, "--gpus", "8", "--nodes", "4", "--seq", "4096", "--global-batch", "256",
                 "--gpu-mem", "80", "--host-mem", "1800", "--grad-ckpt", "--stage", "3", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    c = pl.Choice(3, micro_batch=chosen["micro_batch"], grad_accum=chosen["grad_accum"], grad_ckpt=True)
    w = pl.Workload(preset_shape(model), 4096, 256)
    hw = pl.Hardware(8, 4, 80, 1800)
    # the plan's prediction is the hooks' (or the leaves') one
    same = pl.predict(pl.Workload(preset_shape(model), 4096, 256, zero3_leaves="true" if leaves else "false"), c, hw)
    assert pl.predict(w, c, hw).peak_allocated_gib == pytest.approx(same.peak_allocated_gib)
    assert main(["check", "ds_configs/zero3.json", "--explain", "--world-size", "32", "--gpus", "8", "--gpu-mem", "80",
                 f"model.name={model}", "model.gradient_checkpointing=true", "data.seq_len=4096",
                 f"train.micro_batch_size={chosen['micro_batch']}", f"train.grad_accum={chosen['grad_accum']}"]) == 0
    out = capsys.readouterr().out
    assert "resolved for 32 ranks on GPU nodes of 8 x a 80 GiB GPU (--gpu-mem)" in out and "ZeRO-3, 32 ranks, bf16" in out
    line = next(x for x in out.splitlines() if "ZeRO-3 leaf modules" in x)
    assert line.split(": ", 1)[1].startswith("on" if leaves else "off (train.zero3_leaves=auto: with checkpointing"), line


def test_target_hardware_flags_go_with_explain_and_gpu_mem(capsys: pytest.CaptureFixture[str]) -> None:
    from toolkit.cli import main

    assert main(["check", "ds_configs/zero3.json", "--explain", "--gpus", "8"]) == 1
    assert "give --gpu-mem" in capsys.readouterr().err
    assert main(["check", "ds_configs/zero3.json", "--gpu-mem", "80"]) == 2
