"""LoRA under bf16: fp32 adapters and a bf16 frozen base under DeepSpeed's torch_autocast (stages 0-2),
DeepSpeed's bf16 mode everywhere else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.config import ds_config as dc
from toolkit.config.schema import load_config
from toolkit.runtime.model import build_model, model_config


def _values(autocast: bool) -> dc.AutoValues:
    return dc.AutoValues(micro_batch=2, grad_accum=1, world_size=2, precision="bf16", grad_clip=1.0, lr=1e-4,
                         hidden_size=64, adapter_autocast=autocast)


@pytest.mark.parametrize("preset", ["zero0", "zero1", "zero2", "zero2_offload"])
def test_lora_bf16_below_zero3_resolves_to_torch_autocast(preset: str) -> None:
    ds = dc.preset(preset)
    assert dc.adapter_autocast(ds, "bf16", lora=True)
    out = dc.resolve(ds, _values(True))
    assert out["bf16"]["enabled"] is False
    # lower_precision_safe_modules=[]: no nn.Linear (lora_A/B included) reduces its gradient in bf16
    assert out["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}


@pytest.mark.parametrize(("preset", "precision", "lora"), [
    ("zero3", "bf16", True),  # zero.Init would hold the frozen base in fp32
    ("zero3_offload", "bf16", True),
    ("zero2", "fp16", True),  # fp16 keeps DeepSpeed's loss scaling
    ("zero2", "fp32", True),
    ("zero2", "bf16", False),  # full fine-tuning: DeepSpeed bf16 with fp32 masters
])
def test_other_combinations_keep_deepspeed_precision(preset: str, precision: str, lora: bool) -> None:
    assert not dc.adapter_autocast(dc.preset(preset), precision, lora)


@pytest.mark.parametrize("stage", [3, 3.0, "3"])
def test_zero3_however_written_keeps_deepspeed_bf16(stage: object) -> None:
    ds = dc.preset("zero2")
    ds["zero_optimization"]["stage"] = stage
    assert dc.zero_stage(ds) == 3
    assert not dc.adapter_autocast(ds, "bf16", lora=True)


def test_an_explicit_bf16_flag_in_the_json_is_the_users() -> None:
    ds = dc.preset("zero2")
    ds["bf16"]["enabled"] = True
    assert not dc.adapter_autocast(ds, "bf16", lora=True)
    ds = dc.preset("zero2") | {"torch_autocast": {"enabled": True, "dtype": "float16"}}
    assert not dc.adapter_autocast(ds, "bf16", lora=True)
    assert dc.resolve(ds, _values(False))["torch_autocast"]["dtype"] == "float16"  # left as written


def test_frozen_base_becomes_bf16_and_adapters_stay_fp32() -> None:
    cfg = load_config(None, ["model.name=tiny", "lora.enabled=true"])
    model = build_model(cfg, model_config(cfg), frozen_bf16=True)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    buffers = {n.rsplit(".", 1)[-1]: b.dtype for n, b in model.named_buffers()}
    assert buffers["inv_freq"] == torch.float32  # rotary frequencies are not cast


@pytest.mark.parametrize(("before", "bf16_json", "autocast_now"), [(False, "auto", True), (True, True, False)])
def test_resume_across_precision_modes_is_refused_with_the_fix(
        tmp_path: Path, before: bool, bf16_json: object, autocast_now: bool) -> None:
    from toolkit.runtime.spec import build_spec, read_inputs

    ds = dc.preset("zero2")
    ds["bf16"]["enabled"] = bf16_json
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    run = tmp_path / "run"
    run.mkdir()
    (run / "versions.json").write_text(json.dumps({"adapter_autocast": before}))
    ckpt = run / "checkpoints" / "checkpoint-2"
    (ckpt / "global_step2").mkdir(parents=True)  # a complete Trainer checkpoint (no shards: ZeRO-0-like)
    (ckpt / "complete.json").write_text(json.dumps({"step": 2}))
    cfg = load_config(None, ["model.name=tiny", "lora.enabled=true", "train.precision=bf16", "train.resume=latest",
                             f"train.ds_config={tmp_path / 'ds.json'}", f"train.run_dir={run}"])
    with pytest.raises(dc.ConfigError, match=f"adapter_autocast={before}.*would use {autocast_now}"):
        build_spec(read_inputs(cfg))
    (run / "versions.json").write_text(json.dumps({"adapter_autocast": autocast_now}))
    assert build_spec(read_inputs(cfg)).adapter_autocast is autocast_now  # the same mode resumes


def test_zero_sizes_speed_is_deepspeed_defaults_memory_is_hidden_size_rules() -> None:
    ds = dc.preset("zero3")
    fast = dc.resolve(ds, _values(False))["zero_optimization"]
    assert fast["stage3_prefetch_bucket_size"] == 50_000_000
    assert fast["stage3_max_live_parameters"] == fast["stage3_max_reuse_distance"] == 1_000_000_000
    assert fast["reduce_bucket_size"] == 500_000_000
    import dataclasses

    lean = dc.resolve(ds, dataclasses.replace(_values(False), zero_sizes="memory"))["zero_optimization"]
    assert lean["reduce_bucket_size"] == 64 * 64 and lean["stage3_max_live_parameters"] == 24 * 64 * 64
    z2 = dc.resolve(dc.preset("zero2"), _values(False))["zero_optimization"]
    assert z2["allgather_bucket_size"] == 500_000_000
