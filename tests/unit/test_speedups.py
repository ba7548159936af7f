"""The compile and float8 decisions (toolkit/plan/speedups.py) and the float8 conversion and layer finding
(toolkit/runtime/speed/fp8.py, compile.py) on the CPU: conversion needs no GPU, and meta-device models keep it cheap.
The float8 matmuls themselves run in tests/gpu/test_gpu_compile.py."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForSequenceClassification

from toolkit.config.ds_config import ConfigError
from toolkit.config.models import PRESETS, SPECIAL_IDS
from toolkit.plan.speedups import (
    COMPILE_AUTO_MIN_STEPS,
    compile_on,
    fp8_converts,
    fp8_support_error,
    leaves_blocked,
)
from toolkit.runtime.speed import fp8
from toolkit.runtime.speed.compile import decoder_layers


def _meta(preset: str, auto: type = AutoModelForCausalLM, **over: object) -> torch.nn.Module:
    spec = dict(PRESETS[preset]) | over
    mc = CONFIG_MAPPING[spec.pop("model_type")](**spec, **SPECIAL_IDS)
    with torch.device("meta"):
        return auto.from_config(mc)


def test_compile_auto_rule() -> None:
    on = dict(cuda=True, steps=10_000, fp8=False, stage=2)
    assert compile_on("torch", **on | {"cuda": False})[0]  # an explicit request is honoured
    assert not compile_on("off", **on | {"fp8": True})[0]
    assert compile_on("auto", **on)[0]
    assert not compile_on("auto", **on | {"cuda": False})[0]
    assert compile_on("auto", **on | {"stage": 3})[0]  # the layers are ZeRO-3 leaves: as fast as at ZeRO-2
    # under LoRA they cannot be leaves, and ZeRO-3's hooks split them: slower than eager there
    no, why = compile_on("auto", **on | {"stage": 3, "no_leaves": leaves_blocked(lora=True)})
    assert not no and "under LoRA" in why
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}
    assert leaves_blocked(lora=False, ds=nvme) == "with parameters offloaded to NVMe"
    assert leaves_blocked(lora=False, ds={"zero_optimization": {"offload_param": {"device": "cpu"}}}) is None
    assert compile_on("auto", **on | {"stage": 3, "fp8": True})[0]  # float8 needs it anyway
    short, why = compile_on("auto", **on | {"steps": COMPILE_AUTO_MIN_STEPS - 1})
    assert not short and "too few" in why
    assert compile_on("auto", **on | {"steps": None})[0]  # one epoch of a file: length unknown yet


def test_fp8_size_rule_reads_dimensions() -> None:
    # llama-1b, tensorwise: q/o (2048 -> 2048), gate/up (2048 -> 8192), down (8192 -> 2048) convert; k/v (-> 512) not
    assert [fp8_converts("tensorwise", i, o) for i, o in ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048))] \
        == [True, False, True, True]
    assert [fp8_converts("rowwise", i, o) for i, o in ((2048, 2048), (2048, 8192), (8192, 2048))] == [False, True, False]
    assert not fp8_converts("tensorwise", 8200, 8200)  # not a multiple of 16
    with pytest.raises(ValueError):
        fp8_converts("delayed", 2048, 2048)


def test_fp8_support_error() -> None:
    assert "CPU" in fp8_support_error(None)
    assert "SM 8.0" in fp8_support_error((8, 0), "NVIDIA A100")
    assert fp8_support_error((8, 9)) is None and fp8_support_error((9, 0)) is None


def test_decoder_layers_of_each_family() -> None:
    assert {type(m).__name__ for m in decoder_layers(_meta("tiny"))} == {"LlamaDecoderLayer"}
    assert len(decoder_layers(_meta("gpt2-124m"))) == 12
    assert {type(m).__name__ for m in decoder_layers(_meta("gpt2-124m"))} == {"GPT2Block"}
    bert = _meta("tiny-bert", AutoModelForSequenceClassification)
    assert [type(m).__name__ for m in decoder_layers(bert)] == ["BertLayer", "BertLayer"]
    assert len(decoder_layers(_meta("qwen2-0.5b", num_hidden_layers=2))) == 2


def test_fp8_converts_decoder_linears_only_also_when_zero3_partitioned() -> None:
    model = _meta("llama-1b", num_hidden_layers=2)
    layers = decoder_layers(model)
    q = layers[0].self_attn.q_proj
    weight = q.weight
    stats = fp8.convert(model, layers, "tensorwise")
    assert stats == {"converted": 10, "linears": 14, "skipped": ["self_attn.k_proj", "self_attn.v_proj"]}
    new_q = layers[0].self_attn.q_proj
    assert type(new_q).__name__ == "Float8Linear" and new_q.weight is weight  # the same Parameter: DeepSpeed's
    assert type(model.lm_head) is torch.nn.Linear  # the head stays bf16
    # ZeRO-3 partitions every weight to shape (0,); a filter on weight.shape would convert nothing
    z3 = _meta("llama-1b", num_hidden_layers=2)
    for m in z3.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = torch.empty(0, device="meta")
    assert fp8.convert(z3, decoder_layers(z3), "tensorwise")["converted"] == 10


def test_fp8_too_small_to_pay_is_said_and_no_linear_is_an_error() -> None:
    tiny = _meta("tiny")
    stats = fp8.convert(tiny, decoder_layers(tiny), "tensorwise")
    assert stats["converted"] == 0 and "fp8: off, the run is bf16" in fp8.describe(stats, "tensorwise", 2)
    gpt2 = _meta("gpt2-124m", n_layer=2)
    with pytest.raises(ConfigError, match="Conv1D"):
        fp8.convert(gpt2, decoder_layers(gpt2), "tensorwise")


def test_fp8_is_refused_before_launch_in_one_line() -> None:
    from toolkit.config.schema import load_config

    base = ["train.precision=fp8"]
    cases = {
        "LoRA's adapter matmuls": [*base, "lora.enabled=true"],
        "train.compile=off": [*base, "train.compile=off"],
        "causal_lm models": [*base, "model.task=seq_cls", "model.name=tiny-bert"],
        "CPU ranks": base,
    }
    for needle, over in cases.items():
        with pytest.raises(ConfigError, match=re.escape(needle)):
            fp8.check(load_config(None, over), capability=None)
    with pytest.raises(ConfigError, match=r"train\.fp8_recipe must be tensorwise or rowwise"):
        load_config(None, [*base, "train.fp8_recipe=delayed"])


def test_fp8_trains_in_deepspeeds_bf16_mode_and_refuses_a_json_that_pins_fp16() -> None:
    from toolkit.config.ds_config import precision_of
    from toolkit.config.schema import load_config
    from toolkit.runtime.resolved import Machine, precision_of_run

    cfg = load_config(None, ["train.precision=fp8"])
    gpu = Machine(cuda=True, varlen=True, liger_types=(), gpu_bytes=80 * 2**30, host_bytes=None, ranks_per_node=1,
                  bf16=True)
    assert precision_of_run(cfg, precision_of({"bf16": {"enabled": "auto"}}), gpu)[0] == "bf16"
    with pytest.raises(ConfigError, match="pins fp16"):
        precision_of_run(cfg, precision_of({"fp16": {"enabled": True}}), gpu)
