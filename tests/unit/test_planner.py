"""The planner's formulas (toolkit/plan/planner.py) and the shapes they read (toolkit/plan/shapes.py): pure, no GPU.

The strongest check here is the first: the prediction for every configuration the project has
measured on GPUs so far (bench/results/, issue 11) is within the issue's 10% (GPU peak) and 15% (host).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.config.ds_config import ConfigError
from toolkit.plan import planner as pl
from toolkit.plan.shapes import (
    SHAPES_FILE,
    ModelShape,
    committed_shapes,
    load_shape,
    preset_config,
    read_shape,
)

ROOT = Path(__file__).resolve().parents[2]


def _predict(model: str, seq: int, micro: int, accum: int, n: int, stage: int, offload: pl.Offload = "none",
             ratio: float = 1.0, sizes: str = "speed", liger: bool = True, attn: str = "sdpa", ckpt: bool = False,
             lora: pl.Lora | None = None, gpu_mem: float = 140.0, fused: str = "auto",
             chunks: str = "1") -> pl.Prediction:
    # chunks: model.liger_chunk_mem_const; every row here ran before it existed, at Liger's own chunks (1)
    w = pl.Workload(load_shape(model), seq, micro * accum * n, lora, liger, attn, fused, loss_chunks=chunks)
    return pl.predict(w, pl.Choice(stage, offload, ratio, micro, accum, ckpt, sizes), pl.Hardware(n, 1, gpu_mem))


# (where it was measured, model, seq, micro, accum, ranks, stage, offload, ratio, zero sizes, Liger, attention,
#  checkpointing, LoRA, measured peak allocated GiB per rank). The ZeRO-3 rows with Liger ran before the fused
#  loss was on at ZeRO-3 (kernels.py, aea2610): they are predicted with model.liger_fused_loss=false.
MEASURED_GPU = [
    ("anatomy.md ZeRO-2", "llama-1b", 512, 4, 1, 2, 2, "none", 1, "memory", False, "sdpa", False, None, 15.554),
    ("anatomy.md ZeRO-3", "llama-1b", 512, 4, 1, 2, 3, "none", 1, "memory", False, "sdpa", False, None, 16.051),
    ("two_gpu.md grad_accum 2, ZeRO-2", "llama-1b", 512, 4, 2, 2, 2, "none", 1, "memory", False, "sdpa", False, None, 16.727),
    ("two_gpu.md grad_accum 2, ZeRO-3", "llama-1b", 512, 4, 2, 2, 3, "none", 1, "memory", False, "sdpa", False, None, 16.054),
    ("two_gpu.md ZeRO-3 + offload", "llama-1b", 512, 4, 2, 2, 3, "all", 1, "memory", False, "sdpa", False, None, 6.844),
    ("toolkit-zero-2gpu.json qwen ZeRO-2", "qwen2-0.5b", 512, 2, 6, 2, 2, "none", 1, "memory", False, "sdpa", False, None, 7.302),
    ("toolkit-zero-2gpu.json qwen ZeRO-3", "qwen2-0.5b", 512, 2, 6, 2, 3, "none", 1, "memory", False, "sdpa", False, None, 7.095),
    ("toolkit-zero-2gpu.json qwen offload", "qwen2-0.5b", 512, 2, 6, 2, 3, "all", 1, "memory", False, "sdpa", False, None, 3.414),
    ("toolkit-qwen.json bf16 eager", "qwen2-0.5b", 512, 2, 6, 1, 0, "none", 1, "memory", False, "eager", False, None, 11.603),
    ("toolkit-qwen.json checkpointing", "qwen2-0.5b", 512, 2, 6, 1, 0, "none", 1, "memory", False, "eager", True, None, 11.137),
    ("toolkit-qwen.json LoRA", "qwen2-0.5b", 512, 2, 6, 1, 0, "none", 1, "memory", False, "eager", False, pl.Lora(), 4.805),
    ("toolkit-qwen.json sdpa", "qwen2-0.5b", 512, 2, 6, 1, 0, "none", 1, "memory", False, "sdpa", False, None, 11.136),
    ("toolkit-qwen-all.json all together", "qwen2-0.5b", 512, 2, 6, 1, 0, "none", 1, "memory", False, "sdpa", True, pl.Lora(), 2.786),
    ("toolkit-qwen-zero.json ZeRO-2", "qwen2-0.5b", 512, 2, 6, 1, 2, "none", 1, "memory", False, "sdpa", False, None, 10.509),
    ("toolkit-qwen-zero.json ZeRO-3", "qwen2-0.5b", 512, 2, 6, 1, 3, "none", 1, "memory", False, "sdpa", False, None, 10.505),
    ("toolkit-qwen-zero.json ZeRO-3 offload", "qwen2-0.5b", 512, 2, 6, 1, 3, "all", 1, "memory", False, "sdpa", False, None, 3.410),
    ("speed.json qwen ZeRO-2 raw", "qwen2-0.5b", 2048, 8, 2, 2, 2, "none", 1, "speed", True, "sdpa", False, None, 21.349),
    ("speed/call1 qwen ZeRO-3 raw", "qwen2-0.5b", 2048, 8, 2, 2, 3, "none", 1, "speed", True, "sdpa", False, None, 48.31),
    ("speed.json llama ZeRO-2 raw", "llama-1b", 2048, 16, 1, 2, 2, "none", 1, "speed", True, "sdpa", False, None, 49.349),
    ("speed/s2 llama ZeRO-3 raw (micro 8)", "llama-1b", 2048, 8, 2, 2, 3, "none", 1, "speed", True, "sdpa", False, None, 54.23),
    ("speed.json llama ZeRO-3 + optimizer offload raw", "llama-1b", 2048, 8, 2, 2, 3, "optimizer", 1, "speed", True, "sdpa", False, None, 46.2),
    ("speed.json llama ZeRO-2 bare loop", "llama-1b", 2048, 4, 4, 2, 2, "none", 1, "speed", False, "sdpa", False, None, 35.576),
    ("speed.json llama ZeRO-3 bare loop", "llama-1b", 2048, 4, 4, 2, 3, "none", 1, "speed", False, "sdpa", False, None, 37.218),
    ("speed.json llama ZeRO-3 + offload bare loop", "llama-1b", 2048, 4, 4, 2, 3, "optimizer", 1, "speed", False, "sdpa", False, None, 29.19),
    ("speed.json qwen ZeRO-2 bare loop", "qwen2-0.5b", 2048, 4, 4, 2, 2, "none", 1, "speed", False, "sdpa", False, None, 28.689),
    ("speed/call1 qwen ZeRO-3 bare loop", "qwen2-0.5b", 2048, 4, 4, 2, 3, "none", 1, "speed", False, "sdpa", False, None, 30.077),
    ("issue 11: Llama-2-7B, ratio 0.5, micro 8, 1 H200", "llama-2-7b", 2048, 8, 1, 1, 3, "optimizer", 0.5, "speed", False, "sdpa", True, None, 69.0),
    ("zero3_tuning.md ZeRO-3 micro 16, no fused loss", "llama-1b", 2048, 16, 1, 2, 3, "none", 1, "speed", True, "sdpa", False, None, 96.369),
    ("zero3_tuning.md ZeRO-3 micro 16, fused loss", "llama-1b", 2048, 16, 1, 2, 3, "none", 1, "speed", True, "sdpa", False, None, 50.299),
]
FUSED_AT_ZERO3 = {"zero3_tuning.md ZeRO-3 micro 16, fused loss"}
# (where, model, seq, micro, accum, ranks, stage, offload, ratio, Liger, checkpointing, measured host RSS GiB per rank)
MEASURED_HOST = [
    ("speed.json llama ZeRO-2 raw (fp32 model on the CPU)", "llama-1b", 2048, 16, 1, 2, 2, "none", 1, True, False, 5.917),
    ("speed.json qwen ZeRO-2 raw (fp32 model on the CPU)", "qwen2-0.5b", 2048, 8, 2, 2, 2, "none", 1, True, False, 3.155),
    ("speed/s2 llama ZeRO-3 raw (micro 8)", "llama-1b", 2048, 8, 2, 2, 3, "none", 1, True, False, 2.04),
    ("speed.json llama ZeRO-3 + optimizer offload raw", "llama-1b", 2048, 8, 2, 2, 3, "optimizer", 1, True, False, 14.93),
    ("speed.json llama ZeRO-3 + optimizer offload bare", "llama-1b", 2048, 4, 4, 2, 3, "optimizer", 1, False, False, 14.91),
    ("issue 11: Llama-2-7B, all states on the CPU, micro 1", "llama-2-7b", 2048, 1, 1, 1, 3, "optimizer", 1, False, True, 121.0),
    ("issue 11: Llama-2-7B, ratio 0.5, micro 8", "llama-2-7b", 2048, 8, 1, 1, 3, "optimizer", 0.5, False, True, 76.0),
]


def test_predictions_match_every_committed_gpu_measurement() -> None:
    errors = []
    for where, model, seq, micro, accum, n, stage, off, ratio, sizes, liger, attn, ckpt, lora, measured in MEASURED_GPU:
        fused = "false" if stage == 3 and where not in FUSED_AT_ZERO3 else "auto"
        p = _predict(model, seq, micro, accum, n, stage, off, ratio, sizes, liger, attn, ckpt, lora, fused=fused)
        errors.append(((p.peak_allocated_gib - measured) / measured, where))
    worst = max(errors, key=lambda e: abs(e[0]))
    print(f"\nworst GPU peak error over {len(errors)} measured configurations: {worst[0]:+.1%} ({worst[1]})")
    assert all(abs(e) <= 0.10 for e, _ in errors), [e for e in errors if abs(e[0]) > 0.10]


def test_predictions_match_every_committed_host_measurement() -> None:
    errors = []
    for where, model, seq, micro, accum, n, stage, off, ratio, liger, ckpt, measured in MEASURED_HOST:
        p = _predict(model, seq, micro, accum, n, stage, off, ratio, liger=liger, ckpt=ckpt, fused="false")
        errors.append(((p.host_rank_gib - measured) / measured, where))
    worst = max(errors, key=lambda e: abs(e[0]))
    print(f"\nworst host RSS error over {len(errors)} measured configurations: {worst[0]:+.1%} ({worst[1]})")
    assert all(abs(e) <= 0.15 for e, _ in errors), [e for e in errors if abs(e[0]) > 0.15]


CALIBRATION = ROOT / "bench" / "results" / "calibration" / "calibration.json"


def test_predictions_match_every_calibrated_configuration() -> None:
    """bench/results/calibration/calibration.json (bench/plan_calibrate.py run, 2x H200): every row that ran,
    predicted again with the formulas as they are now, against its measured per-rank peaks (all ranks)."""
    rows = [r for r in json.loads(CALIBRATION.read_text())["rows"] if r["rc"] == 0 and r.get("measured")]
    assert len(rows) >= 14
    gpu, host = [], []
    for r in rows:
        c = r["config"]
        p = _predict(c["model"], c["seq"], c["micro"], c["accum"], c["gpus"], c["stage"], c["offload"], c["ratio"],
                     c["zero_sizes"], c["liger"], ckpt=c["ckpt"], lora=pl.Lora() if c["lora"] else None,
                     fused=c["fused_loss"])
        for m in r["measured"]["per_rank"].values():
            gpu.append(((p.peak_allocated_gib - m["peak_allocated_gib"]) / m["peak_allocated_gib"], c["name"]))
            host.append(((p.host_rank_gib - m["host_rss_gib"]) / m["host_rss_gib"], c["name"]))
    for what, errors, limit in (("GPU peak", gpu, 0.10), ("host RSS", host, 0.15)):
        worst = max(errors, key=lambda e: abs(e[0]))
        print(f"\nworst {what} error over {len(rows)} calibrated configurations: {worst[0]:+.1%} ({worst[1]})")
        assert all(abs(e) <= limit for e, _ in errors), [e for e in errors if abs(e[0]) > limit]


BIGRUNS = sorted((ROOT / "bench" / "results" / "bigrun").glob("*/bigrun.json"))


def test_predictions_match_the_big_runs() -> None:
    """bench/results/bigrun/ (bench/plan_calibrate.py bigrun, H200s): the plan's own choice for the 6.7B and 8B
    shapes on one GPU, and the 8B shape at ZeRO-3 on four, trained 10 steps. Predicted again now, against the peaks
    each rank measured."""
    assert len(BIGRUNS) >= 3
    for f in BIGRUNS:
        r = json.loads(f.read_text())
        assert r["rc"] == 0 and r["loss_falls"], f
        c, over = r["chosen"], r["chosen"]["train_overrides"]
        ranks = list(r["measured"]["per_rank"].values())
        w = pl.Workload(load_shape(over["model.name"]), over["data.seq_len"],
                        c["micro_batch"] * c["grad_accum"] * len(ranks), None,
                        c["liger"], "sdpa", "true" if c["fused_loss"] else "false", over.get("train.compile", "auto"),
                        over.get("train.fp8_recipe") if over.get("train.precision") == "fp8" else None,
                        loss_chunks="1")  # the runs had Liger's own loss chunks
        p = pl.predict(w, pl.Choice(c["stage"], c["offload"], c["offload_ratio"], c["micro_batch"], c["grad_accum"],
                                    c["grad_ckpt"], c["zero_sizes"]), pl.Hardware(len(ranks), 1, 139.0))
        # The planner does not model what compiling adds to the host: inductor's compiled code and caches measured
        # +0.54 GiB in one 7B run (i25-7b-compile) and +0.07 in another (i25-7b-fp8), so the compiled runs get a
        # 0.6 GiB allowance on a 2 GiB process.
        slack = 0.6 if over.get("train.compile") == "torch" or over.get("train.precision") == "fp8" else 0.0
        for m in ranks:
            assert abs(p.peak_allocated_gib - m["peak_allocated_gib"]) / m["peak_allocated_gib"] <= 0.10, f
            assert abs(p.host_rank_gib - m["host_rss_gib"]) <= 0.15 * m["host_rss_gib"] + slack, f


def test_lora_under_adapter_autocast() -> None:
    """q-z2-lora-s2048-m4 (calibration.md): ZeRO-2, fp32 adapters on a bf16 base under torch autocast.
    Measured 10.22 GiB peak allocated and 2.31 GiB host RSS; bf16 reduce buckets, one shared saved input
    per layer and the fp32 model on the host had predicted 8.23 and 3.16."""
    s = load_shape("qwen2-0.5b")
    p = _predict("qwen2-0.5b", 2048, 4, 1, 1, 2, lora=pl.Lora())
    assert p.phase == "top layer backward"
    assert p.gpu["buckets"] == pytest.approx(2 * 4 * 500_000_000 / pl.GIB)  # fp32 ipg double buffer
    assert abs(p.peak_allocated_gib - 10.221) / 10.221 <= 0.10
    assert abs(p.host_rank_gib - 2.308) / 2.308 <= 0.15
    # q_proj and v_proj each keep their own bf16 copy of the layer's input under autocast (PEFT casts it
    # to fp32, autocast back to bf16): 2h more per layer and token than with one shared input
    kw = dict(seq_len=2048, attn="sdpa", liger=True, lora=pl.Lora())
    assert (pl.layer_activation_bytes(s, autocast=True, **kw) - pl.layer_activation_bytes(s, **kw)
            == 2 * s.hidden_size)
    # the fp32 model still exists on the host while build_model runs: the node's need counts it
    full = _predict("qwen2-0.5b", 2048, 4, 1, 1, 2)
    assert p.host_build_rank_gib == pytest.approx(full.host_rank_gib) and p.host_build_rank_gib > p.host_rank_gib
    assert p.host_node_gib == pytest.approx(full.host_node_gib)
    # at ZeRO-3 DeepSpeed's bf16 mode holds adapters and activations in bf16: nothing of this applies
    z3 = _predict("qwen2-0.5b", 2048, 4, 1, 1, 3, lora=pl.Lora())
    assert "buckets" not in z3.gpu and z3.host_build_rank_gib == 0.0


def test_committed_preset_shapes_are_the_meta_device_read() -> None:
    from toolkit.config.models import PRESETS

    committed = committed_shapes()
    assert sorted(committed) == sorted(PRESETS), f"regenerate {SHAPES_FILE.name}: python -m toolkit.plan.shapes"
    for name in PRESETS:  # BERT presets as the sequence classifier the toolkit trains
        assert read_shape(preset_config(name)) == ModelShape.from_json(committed[name]["shape"]), name
    assert load_shape("llama-1b").total_params == 1_235_814_400  # bench/results/speed/*: n_params
    assert load_shape("qwen2-0.5b").total_params == 494_032_768
    assert load_shape("llama-3-8b").total_params == 8_030_261_248


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none"), (2, "none"), (2, "optimizer"), (3, "none"),
                                           (3, "optimizer"), (3, "all")])
@pytest.mark.parametrize("ckpt", [False, True])
def test_peak_grows_with_the_micro_batch(stage: int, offload: pl.Offload, ckpt: bool) -> None:
    peaks = [_predict("llama-1b", 2048, m, 16 // m, 2, stage, offload, ckpt=ckpt).peak_allocated_gib
             for m in (1, 2, 4, 8, 16)]
    assert peaks == sorted(peaks), peaks


def test_zero3_peaks_below_zero2_per_rank_from_three_ranks_on() -> None:
    """anatomy.md: ZeRO-3 holds 4P/N of weights and gradient buffer against ZeRO-2's 2P (grad_accum 1)."""
    z2, z3 = ({n: _predict("llama-1b", 512, 4, 1, n, s, sizes="memory", liger=False).peak_allocated_gib
               for n in (2, 3, 4, 8)} for s in (2, 3))
    assert z3[2] > z2[2]  # measured on 2 ranks: 16.05 vs 15.55 GiB
    assert all(z3[n] < z2[n] for n in (3, 4, 8)), (z2, z3)


def test_offload_moves_bytes_from_the_gpu_to_the_host() -> None:
    def both(off: pl.Offload, ratio: float = 1.0, stage: int = 3) -> tuple[float, float]:
        p = _predict("llama-3-8b", 2048, 2, 8, 1, stage, off, ratio, ckpt=True)
        return p.peak_allocated_gib, p.host_rank_gib

    none, opt, every = both("none"), both("optimizer"), both("all")
    assert none[0] > opt[0] > every[0] and none[1] < opt[1] < every[1]
    split = [both("optimizer", r) for r in (0.25, 0.5, 0.75, 1.0)]
    assert [g for g, _ in split] == sorted((g for g, _ in split), reverse=True)
    assert [h for _, h in split] == sorted(h for _, h in split)
    z2, z2o = both("none", stage=2), both("optimizer", stage=2)
    assert z2o[0] < z2[0] and z2o[1] > z2[1]


def test_lora_shrinks_the_optimizer_states() -> None:
    full = _predict("llama-3-8b", 2048, 1, 1, 1, 3)
    lora = _predict("llama-3-8b", 2048, 1, 1, 1, 3, lora=pl.Lora())
    assert pl.trainable_params(load_shape("llama-3-8b"), pl.Lora()) == 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    assert lora.persistent["optimizer"] < full.persistent["optimizer"] / 1000
    assert lora.peak_allocated_gib < full.peak_allocated_gib / 3


def test_checkpointing_and_the_fused_loss_lower_the_peak() -> None:
    plain = _predict("llama-1b", 2048, 8, 1, 2, 2, liger=False)
    assert _predict("llama-1b", 2048, 8, 1, 2, 2, liger=False, ckpt=True).peak_allocated_gib < plain.peak_allocated_gib
    fused = _predict("llama-1b", 2048, 8, 1, 2, 2)
    assert fused.fused_loss and not plain.fused_loss and fused.peak_allocated_gib < plain.peak_allocated_gib
    z3, z3_plain = _predict("llama-1b", 2048, 16, 1, 2, 3), _predict("llama-1b", 2048, 16, 1, 2, 3, fused="false")
    assert z3.fused_loss and not z3_plain.fused_loss and z3_plain.liger  # toolkit/runtime/speed/kernels.py: on unless false
    assert z3.peak_allocated_gib < z3_plain.peak_allocated_gib / 1.8  # measured 50.3 vs 96.4 GiB


def test_one_layers_activations_match_the_anatomy_count() -> None:
    """anatomy.md: 3.35 GiB saved for backward by 16 layers x 2048 tokens of llama-1b (sdpa, no Liger), 108.7 kB a token
    a layer; the trace of the model's own code gives 108,680 (the hand count was 108,672, less two fp32 rstd)."""
    per = pl.layer_activation_bytes(load_shape("llama-1b"), seq_len=512, attn="sdpa", liger=False, lora=None)
    assert per == 108_680
    assert abs(16 * 2048 * per / pl.GIB - 3.32) < 0.05


def test_deepspeed_estimators_agree_where_they_overlap() -> None:
    """DeepSpeed's estimators count model states only; where the planner's phases hold the same states
    they must give the same bytes (the rest is what the estimators miss)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = load_shape("llama-3-8b")
    p_all = shape.total_params
    for n in (1, 2, 8):
        _, ds_gpu = estimate_zero2_model_states_mem_needs(p_all, n, 1, cpu_offload=False)
        ours = _predict("llama-3-8b", 512, 1, 1, n, 2, gpu_mem=1e6)
        states = (ours.persistent["params"] + ours.persistent["optimizer"]) * pl.GIB
        step = ours.gpu["step"] * pl.GIB if ours.phase == "optimizer step" else 8.0 * p_all / n
        # the step's states are DeepSpeed's 2P + 18P/N, plus the bf16 flatten copy it does not count
        assert abs(states + step - (ds_gpu + 2.0 * p_all / n)) < 16, n
        _, ds_off = estimate_zero2_model_states_mem_needs(p_all, n, 1, cpu_offload=True)
        assert _predict("llama-3-8b", 512, 1, 1, n, 2, "optimizer").persistent["params"] * pl.GIB == ds_off
        # ZeRO-3 with the optimizer on the CPU: DeepSpeed's GPU term beside the largest layer is the 2P/N
        # partition; the planner's also keeps parameters under the persistence threshold whole
        largest = max(shape.param_numels())
        ds_cpu, ds_gpu3, _ = estimate_zero3_model_states_mem_needs(p_all, largest, n, 1, cpu_offload=True,
                                                                   cpu_offload_params=False)
        z3 = _predict("llama-3-8b", 512, 1, 1, n, 3, "optimizer")
        small = 2.0 * sum(x for x in shape.param_numels() if x <= 100_000)
        assert abs(z3.persistent["params"] * pl.GIB - (ds_gpu3 - 4 * largest) - small) <= 2 * n
        # host: DeepSpeed's 16 bytes x P per node, times its 1.5 buffer factor, brackets the planner's
        # pinned buffers with their power-of-two rounding
        states_node = (z3.host_rank_gib - pl.HOST_BASELINE_GIB) * pl.GIB * n
        assert 16.0 * p_all <= states_node <= ds_cpu, (n, states_node / 1e9, ds_cpu / 1e9)


def test_the_planner_finds_a_partial_offload_for_8b_on_one_h200() -> None:
    """Issue 11: on one H200 (139 GiB) with 125 GiB of host RAM, Llama-3-8B fits only with part of the
    optimizer on the CPU; the 6.7B shape fits with nothing offloaded, faster than issue 11's 3,180 tokens/s."""
    w = pl.Workload(load_shape("llama-3-8b"), 2048, 16)
    hw = pl.Hardware(1, 1, 139.0, 125.0)
    chosen = pl.best(pl.plan(w, hw))
    assert chosen is not None and chosen.choice.stage == 3 and chosen.choice.offload == "optimizer"
    assert 0 < chosen.choice.ratio < 1 and chosen.gpu_need_gib <= 139 and chosen.host_node_gib <= 125
    seven = pl.best(pl.plan(pl.Workload(load_shape("llama-2-7b"), 2048, 8), hw))
    assert seven is not None and seven.tokens_per_s_per_gpu > 3180


def test_fitting_micro_batches_largest_first() -> None:
    ds = {"zero_optimization": {"stage": 2}}
    shape = load_shape("llama-1b")
    got = pl.fitting_micro_batches(shape, ds, 2, 2048, 16, 40.0)
    assert got == sorted(got, reverse=True) and got and got[0] < 16  # micro 16 needs ~57 GiB (measured 49.35 peak)
    w = pl.Workload(shape, 2048, 32)
    for m in pl.divisors(16):
        fits = pl.predict(w, pl.Choice(2, micro_batch=m, grad_accum=16 // m), pl.Hardware(2, 1, 40.0)).fits_gpu
        assert (m in got) == fits
    assert pl.fitting_micro_batches(shape, ds, 2, 2048, 16, 8.0) == []
    off = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    assert pl.choice_from_ds(off, micro_batch=2, grad_accum=4, grad_ckpt=True) == pl.Choice(3, "optimizer", 0.5, 2, 4,
                                                                                            True)


def test_fitting_micro_batches_takes_the_training_model_config() -> None:
    """autotune passes train.py's HF config object: its shape is read on the meta device once."""
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import model_config

    mc = model_config(load_config(None, ["model.name=qwen2-0.5b", "data.seq_len=1024"]))
    ds = {"zero_optimization": {"stage": 3}}
    by_config = pl.fitting_micro_batches(mc, ds, 1, 1024, 32, 24.0, grad_ckpt=True, lora=pl.Lora())
    assert by_config == pl.fitting_micro_batches(load_shape("qwen2-0.5b"), ds, 1, 1024, 32, 24.0, grad_ckpt=True,
                                                 lora=pl.Lora())
    assert by_config and by_config[0] > pl.fitting_micro_batches(load_shape("qwen2-0.5b"), ds, 1, 1024, 32, 24.0)[0]
    assert pl.fitting_micro_batches(mc, ds, 1, 1024, 32, 24.0, lora=True) == pl.fitting_micro_batches(
        mc, ds, 1, 1024, 32, 24.0, lora=pl.Lora(8, ("q_proj", "v_proj")))
    unfused = pl.fitting_micro_batches(mc, ds, 1, 1024, 32, 24.0, fused_loss="false")
    assert unfused[0] < pl.fitting_micro_batches(mc, ds, 1, 1024, 32, 24.0)[0]  # the logits cost memory


def test_a_70b_plan_answers_fast() -> None:
    """Issue 11: under 2 s on the development machine. Measured and reported, not asserted (timing flakes)."""
    cmd = [sys.executable, "-m", "toolkit", "plan", "--model", "llama-3-70b", "--gpus", "8", "--nodes", "4",
           "--seq", "4096", "--global-batch", "256", "--gpu-mem", "80", "--host-mem", "1800", "--json"]
    # as leaf modules with checkpointing every layer stays gathered (planner._gathered_bytes): 141 GB of weights
    leaves = subprocess.run([*cmd, "--zero3-leaves", "true"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert leaves.returncode == 1 and "--zero3-leaves false" in leaves.stderr, leaves.stderr
    t0 = time.perf_counter()
    # by default (auto) the checkpointed choices take hooks there, as the run decides (speedups.leaves_on): it plans
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    print(f"\ntoolkit plan for llama-3-70b (70.6B, 32 GPUs): {took:.2f} s wall, {len(data['candidates'])} candidates")


def test_a_local_model_directory_is_read_on_the_meta_device_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from toolkit.plan import shapes

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "model")
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    first = load_shape(str(tmp_path / "model"))
    assert first.num_layers == 3 and first.tied_embeddings and first.total_params == 1000 * 64 + 3 * first.layer_numel + 64
    assert len(list((tmp_path / "cache" / "shapes").glob("*.json"))) == 1
    monkeypatch.setattr(shapes, "read_shape", lambda mc: pytest.fail("read again instead of the cache"))
    assert load_shape(str(tmp_path / "model")) == first


# Issue 25 (one H200, bench/results/speed.json runs s20-s23; toolkit-bert.json, toolkit-zero-2gpu.json):
# (where, model, seq, micro, accum, ranks, stage, offload, zero sizes, Liger, train.compile, fp8 recipe,
#  measured peak allocated GiB, measured tokens/s per GPU or None where the speed model is not calibrated)
MEASURED_ISSUE25 = [
    ("s20 llama ZeRO-2 raw, Liger", "llama-1b", 2048, 16, 2, 1, 2, "none", "speed", True, "off", None, 58.6, 67_200),
    ("s20 llama ZeRO-2 compiled", "llama-1b", 2048, 16, 2, 1, 2, "none", "speed", True, "torch", None, 59.4, 67_700),
    ("s20 llama ZeRO-2 fp8", "llama-1b", 2048, 16, 2, 1, 2, "none", "speed", True, "auto", "tensorwise", 50.8, 79_900),
    ("s20 llama ZeRO-2 fp8 micro 32", "llama-1b", 2048, 32, 1, 1, 2, "none", "speed", True, "auto", "tensorwise", 78.5,
     80_400),
    ("s26 llama ZeRO-3 fp8 (leaf layers)", "llama-1b", 2048, 16, 2, 1, 3, "none", "speed", True, "auto", "tensorwise",
     49.9, 80_300),
    ("s26 llama ZeRO-3 compiled (leaf layers)", "llama-1b", 2048, 16, 2, 1, 3, "none", "speed", True, "torch", None, 58.5,
     67_800),
    ("s26 llama ZeRO-3 raw", "llama-1b", 2048, 16, 2, 1, 3, "none", "speed", True, "off", None, 57.6, 63_700),
    ("s22 qwen ZeRO-2 raw", "qwen2-0.5b", 2048, 8, 4, 1, 2, "none", "speed", True, "off", None, 24.6, None),
    ("s22 qwen ZeRO-2 compiled", "qwen2-0.5b", 2048, 8, 4, 1, 2, "none", "speed", True, "torch", None, 24.7, None),
    ("s22 qwen ZeRO-2 fp8", "qwen2-0.5b", 2048, 8, 4, 1, 2, "none", "speed", True, "auto", "tensorwise", 20.7, None),
    ("s21 gpt2 ZeRO-2 eager", "gpt2-124m", 1024, 16, 2, 1, 2, "none", "speed", True, "off", None, 19.9, None),
    ("s21 gpt2 ZeRO-2 compiled", "gpt2-124m", 1024, 16, 2, 1, 2, "none", "speed", True, "torch", None, 16.0, None),
    ("s7 gpt2 ZeRO-2 2 GPUs raw", "gpt2-124m", 1024, 16, 1, 2, 2, "none", "speed", True, "off", None, 19.0, None),
    ("toolkit-bert.json bf16 sdpa ZeRO-0", "bert-large", 512, 4, 1, 1, 0, "none", "memory", True, "off", None, 7.556,
     None),
    ("toolkit-zero-2gpu.json bert ZeRO-2", "bert-large", 512, 4, 1, 2, 2, "none", "memory", True, "off", None, 4.55, None),
    ("toolkit-zero-2gpu.json bert ZeRO-3", "bert-large", 512, 4, 1, 2, 3, "none", "memory", True, "off", None, 4.27, None),
    ("toolkit-zero-2gpu.json bert ZeRO-3 offload", "bert-large", 512, 4, 1, 2, 3, "all", "memory", True, "off", None,
     1.78, None),
]


def test_compile_fp8_gpt2_and_bert_predictions_match_what_ran() -> None:
    mem, speed = [], []
    for where, model, seq, micro, accum, n, stage, off, sizes, liger, comp, fp8, peak, tps in MEASURED_ISSUE25:
        w = pl.Workload(load_shape(model), seq, micro * accum * n, None, liger, "sdpa", "auto", comp, fp8,
                        loss_chunks="1")  # the runs had Liger's own loss chunks
        p = pl.predict(w, pl.Choice(stage, off, 1.0, micro, accum, False, sizes), pl.Hardware(n, 1, 140.0))
        mem.append(((p.peak_allocated_gib - peak) / peak, where))
        if tps:
            speed.append(((p.tokens_per_s_per_gpu - tps) / tps, where))
    print(f"\nworst GPU peak error: {max(mem, key=lambda e: abs(e[0]))}; worst speed error: {max(speed, key=lambda e: abs(e[0]))}")
    assert all(abs(e) <= 0.10 for e, _ in mem), [e for e in mem if abs(e[0]) > 0.10]
    assert all(abs(e) <= 0.10 for e, _ in speed), [e for e in speed if abs(e[0]) > 0.10]


def test_bert_plans_as_the_classifier_it_trains() -> None:
    shape = load_shape("bert-large")
    assert shape.task == "seq_cls" and shape.model_type == "bert"
    w = pl.Workload(shape, 512, 8, None, True, "sdpa", "auto")
    p = pl.predict(w, pl.Choice(2, "none", 1.0, 4, 1, False, "speed"), pl.Hardware(2, 1, 80.0))
    assert "loss" not in p.gpu and not p.liger and not p.fused_loss  # no vocabulary-sized logits, no Liger


def test_a_preference_run_plans_pairs_its_reference_and_no_logits() -> None:
    """A DPO micro-batch is two sequences a pair; the engine reference adds a ZeRO-3 partition and a forward, the
    precomputed one neither; the chunked head holds no [tokens, vocabulary] logits."""
    hw = pl.Hardware(2, 1, 139.0, None)
    c = pl.Choice(2, "none", 1.0, 4, 1, False)
    shape = load_shape("llama-1b")
    sft = pl.predict(pl.Workload(shape, 2048, 8, attn="sdpa", fused_loss="false", compile="off"), c, hw)
    dpo = {ref: pl.predict(pl.Workload(shape, 1024, 8, compile="off", objective="dpo", reference=ref), c, hw)
           for ref in ("engine", "adapter", "precomputed")}
    # the same tokens per micro-batch as SFT at twice the length, without SFT's whole logits
    assert dpo["precomputed"].peak_allocated_gib < sft.peak_allocated_gib
    engine_bytes = 2.0 * shape.total_params / 2 / pl.GIB
    assert dpo["engine"].persistent["params"] - dpo["adapter"].persistent["params"] == pytest.approx(
        engine_bytes, rel=0.05)
    # a reference forward costs a third of a step or so; precomputed runs none
    assert dpo["precomputed"].tokens_per_s_per_gpu > 1.25 * dpo["adapter"].tokens_per_s_per_gpu
    assert dpo["adapter"].tokens_per_s_per_gpu > dpo["engine"].tokens_per_s_per_gpu
    with pytest.raises(ConfigError, match="preference and RL objectives"):
        pl.predict(pl.Workload(shape, 1024, 8, objective="dpo", fp8="tensorwise"), c, hw)
    # kto: a row is a completion and a mismatched one, with the reference, as a pair is
    kto = pl.predict(pl.Workload(shape, 1024, 8, compile="off", objective="kto", reference="engine"), c, hw)
    assert kto.peak_allocated_gib == pytest.approx(dpo["engine"].peak_allocated_gib)
    assert kto.tokens_per_s_per_gpu == pytest.approx(dpo["engine"].tokens_per_s_per_gpu)


def test_a_grpo_run_plans_its_completions_and_its_rollout() -> None:
    """A GRPO micro-batch holds each prompt's completions (prompt + completion tokens each); the rollout (the gathered
    model under ZeRO-3, one generate call's KV cache) is a phase of its own, the peak where the cache is large; the
    plan takes no Liger kernels (the run does not). Checked against runs: bench/results/grpo/ (llama-1b, 4 prompts x
    8 x (128 + 256) tokens, ZeRO-3: 44.3 predicted against 42.9 GiB measured on 1 GPU, 36.2 against 35.6 on 2)."""
    hw = pl.Hardware(1, 1, 139.0, None)
    shape = load_shape("llama-1b")
    c = pl.Choice(3, "none", 1.0, 4, 1, False)
    grpo = pl.Workload(shape, 384, 4, objective="grpo", generations=8, completion_len=256)
    p = pl.predict(grpo, c, hw)
    assert not p.liger and p.phase == "backward start"
    sft = pl.predict(pl.Workload(shape, 384 * 8, 4, fused_loss="false", compile="off", liger=False), c, hw)
    assert p.gpu["activations"] == pytest.approx(sft.gpu["activations"], rel=0.05)  # the same tokens a micro-batch
    # long completions, many a rollout (64 prompts a step x 2, one generate call of 128), a small update: the KV
    # cache outgrows the update
    long = pl.predict(pl.Workload(shape, 8192 + 128, 64, objective="grpo", generations=2, completion_len=8192),
                      pl.Choice(3, "none", 1.0, 1, 64, True), hw)
    assert long.phase == "rollout" and long.gpu["rollout"] > 2.0 * shape.total_params / pl.GIB
    with pytest.raises(ConfigError, match="prompt plus its completion"):
        pl.predict(pl.Workload(shape, 256, 4, objective="grpo", completion_len=256), c, hw)


def test_auto_micro_batches_of_pairs_count_two_sequences_and_the_reference() -> None:
    """train.micro_batch_size=auto on a preference run: the planner's candidates are pairs with the run's reference
    (run_settings reads them from the config); GRPO and a precomputed reference are refused before any probe."""
    from toolkit.config.schema import load_config
    from toolkit.runtime.speed.autotune import _check_objective

    ds = {"zero_optimization": {"stage": 2}}
    shape = load_shape("llama-1b")
    sft = pl.fitting_micro_batches(shape, ds, 1, 2048, 16, 40.0, compile="off")
    full = load_config(None, ["train.objective=dpo"])
    settings = pl.run_settings(full, False, False)
    assert (settings["objective"], settings["reference"]) == ("dpo", "engine")
    assert pl.run_settings(load_config(None, ["train.objective=dpo", "lora.enabled=true"]), False, False)[
        "reference"] == "adapter"
    assert pl.run_settings(load_config(None, ["train.objective=simpo"]), False, False)["reference"] == "none"
    dpo = pl.fitting_micro_batches(shape, ds, 1, 2048, 16, 40.0, **settings)
    assert dpo and dpo[0] < sft[0]  # a pair is two sequences, and the engine reference's partition
    from toolkit.runtime.objectives.losses import REFERENCE_FREE
    assert pl.REFERENCE_FREE_OBJECTIVES == REFERENCE_FREE  # the planner's copy (plan/ imports nothing of runtime/)
    _check_objective(full)
    with pytest.raises(ConfigError, match="precomputed"):
        _check_objective(load_config(None, ["train.objective=dpo", "pref.reference=precomputed"]))
    with pytest.raises(ConfigError, match="number of prompts"):
        _check_objective(load_config(None, ["train.objective=grpo"]))


def test_the_choice_takes_no_offload_where_one_fits_unless_offload_is_clearly_faster() -> None:
    """Issue 50's case: ZeRO-3 with everything on the CPU predicted 3,122 tokens/s, ZeRO-0 3,196, and the old rule (the
    smaller GPU need within 5%) took the offload, which ran at 0.55x. Offload now wins only by more than
    OFFLOAD_MARGIN, or where nothing without it fits; among ties the fewest moving parts, then the GPU need."""
    from dataclasses import replace

    shape = load_shape("llama-1b")
    base = pl.predict(pl.Workload(shape, 2048, 8), pl.Choice(0, "none", 1.0, 1, 8, True), pl.Hardware(1, 1, 139.0))

    def pred(stage: int, offload: str, tps: float, need: float, fits: bool = True) -> pl.Prediction:
        return replace(base, choice=pl.Choice(stage, offload, 1.0, 1, 8, True), tokens_per_s_per_gpu=tps,
                       gpu_need_gib=need, fits_gpu=fits)

    plain, offloaded = pred(0, "none", 3196, 52.9), pred(3, "all", 3122, 35.2)
    assert pl.best([plain, offloaded]) is plain
    assert "no offload: one fits" in pl.why_chosen([plain, offloaded])
    faster = pred(3, "optimizer", 3196 * 1.2, 40.0)
    assert pl.best([plain, faster]) is faster and "1.20x" in pl.why_chosen([plain, faster])
    assert pl.best([plain, pred(3, "optimizer", 3196 * 1.1, 40.0)]) is plain  # within the margin
    alone = pred(0, "none", 5000, 200.0, fits=False)
    assert pl.best([alone, offloaded]) is offloaded and "no choice without it fits" in pl.why_chosen([alone, offloaded])
    # ties without offload: the smaller GPU need, as before
    zero3 = pred(3, "none", 3150, 40.0)
    assert pl.best([plain, zero3, offloaded]) is zero3
    assert pl.moving_parts(offloaded) == 2 and pl.moving_parts(zero3) == 0


def test_a_4bit_base_is_planned_as_packed_weights_with_scales_kept_whole() -> None:
    """QLoRA (--load-in-4bit): the decoder layers' Linears at 4 bits plus their scales; ZeRO-3 partitions the packed
    weights, not the scales; the head and the rest stay bf16; LoRA only. Llama-3-70B on 2 GPUs at ZeRO-3: about 18
    GiB of parameters a rank (the issue's arithmetic), where its bf16 LoRA holds 66."""
    s = load_shape("llama-3-70b")
    lora = pl.Lora(8, ("q_proj", "v_proj"))
    c = pl.Choice(3, "none", 1.0, 1, 8, True, "speed")
    hw = pl.Hardware(2, 1, 80.0)
    q4 = pl.predict(pl.Workload(s, 2048, 16, lora, load_in_4bit=True), c, hw)
    bf16 = pl.predict(pl.Workload(s, 2048, 16, lora), c, hw)
    linears = pl.quantized_numel(s)
    rest = s.total_params - linears
    small = sum(x for x in s.param_numels() if x <= pl.ZeroSizes.named("speed", s.hidden_size).persistence_threshold)
    want = (2.0 * rest / 2 + pl.BNB4_BYTES * linears / 2 + pl.BNB4_SCALE_BYTES * linears + 2.0 * small) / pl.GIB
    assert q4.persistent["params"] == pytest.approx(want, rel=1e-6)
    assert 17 < q4.persistent["params"] < 20 and bf16.persistent["params"] > 60
    assert q4.host_build_rank_gib > 4 * s.total_params / pl.GIB  # from a directory: the float model, whole
    # a preset is quantized while built (runtime/quant build_4bit): the float weights that stay and one Linear
    bounded = pl.predict(pl.Workload(s, 2048, 16, lora, load_in_4bit=True, quantized_build=True), c, hw)
    stays = 4.0 * (s.total_params - pl.quantized_numel(s)) / pl.GIB
    assert stays < bounded.host_build_rank_gib - pl.HOST_EARLY_GIB < stays + 1.0 < 12
    assert bounded.host_node_gib < 250 < q4.host_node_gib  # the issue's 70B case on 2 GPUs and 250 GiB of host RAM
    at_zero2 = pl.predict(pl.Workload(load_shape("llama-1b"), 2048, 8, lora, load_in_4bit=True),
                          pl.Choice(2, "none", 1.0, 4, 1, False, "speed"), pl.Hardware(2, 1, 80.0))
    plain = pl.predict(pl.Workload(load_shape("llama-1b"), 2048, 8, lora),
                       pl.Choice(2, "none", 1.0, 4, 1, False, "speed"), pl.Hardware(2, 1, 80.0))
    saved = (2.0 - pl.BNB4_BYTES - pl.BNB4_SCALE_BYTES) * pl.quantized_numel(load_shape("llama-1b")) / pl.GIB
    assert plain.persistent["params"] - at_zero2.persistent["params"] == pytest.approx(saved, rel=1e-6)
    with pytest.raises(ConfigError, match="trains LoRA adapters"):
        pl.predict(pl.Workload(s, 2048, 16, None, load_in_4bit=True), c, hw)


def test_a_4bit_base_pays_its_dequantization_per_linear_call() -> None:
    """QLoRA's speed (issue 61 item 5): each quantized Linear call adds BNB4_CALL_S (dequantize, then a bf16 matmul),
    fitted on the llama-1b row of bench/results/qlora/ (50,416 tokens/s measured, 63,172 for bf16 LoRA): that row is
    predicted within 15%, at the measured ratio to bf16 LoRA within 3%; checkpointing's recompute calls each once more."""
    s, lora, hw = load_shape("llama-1b"), pl.Lora(8, ("q_proj", "v_proj")), pl.Hardware(1, 1, 139.0)
    c = pl.Choice(2, "none", 1.0, 4, 1, False, "speed")
    q4 = pl.predict(pl.Workload(s, 2048, 4, lora, load_in_4bit=True), c, hw)
    bf16 = pl.predict(pl.Workload(s, 2048, 4, lora), c, hw)
    assert q4.tokens_per_s_per_gpu / 50_416 - 1 == pytest.approx(0.0, abs=0.15)
    assert q4.tokens_per_s_per_gpu / bf16.tokens_per_s_per_gpu == pytest.approx(50_416 / 63_172, abs=0.03)
    calls = s.num_layers * len(s.linears)
    assert q4.step_time_s - bf16.step_time_s == pytest.approx(2 * calls * pl.BNB4_CALL_S, rel=1e-6)
    ck = dataclasses.replace(c, grad_ckpt=True)
    extra = (pl.predict(pl.Workload(s, 2048, 4, lora, load_in_4bit=True), ck, hw).step_time_s
             - pl.predict(pl.Workload(s, 2048, 4, lora), ck, hw).step_time_s)
    assert extra == pytest.approx(3 * calls * pl.BNB4_CALL_S, rel=1e-6)


def _console(name: str) -> tuple[float, float]:
    """(tokens/s, peak GiB allocated) from a committed run's closing summary."""
    text = (ROOT / "bench" / "results" / "qlora" / f"{name}.log").read_text()
    tokens = float(re.search(r"tokens/s\s+([\d,]+)", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    peak = float(re.search(r"peak GPU\s+rank 0 ([\d.]+) GiB", text).group(1))  # type: ignore[union-attr]
    return tokens, peak


@pytest.mark.parametrize("layers, prefix", [(16, "llama1b"), (8, "llama3-8b-l8"), (32, "llama3-8b")])
def test_4bit_and_bf16_lora_peaks_are_planned_within_10_percent(layers: int, prefix: str) -> None:
    """Every committed QLoRA row (bench/results/qlora/: one H200, ZeRO-2, micro 4 x 2048, LoRA r=8 on q and v):
    `toolkit plan --load-in-4bit` within 10% of the measured peak, and bf16 LoRA's too. At the whole Llama-3-8B shape
    the 4-bit base runs at >= 0.85x bf16 LoRA's tokens/s with a peak >= 8 GiB lower (the issue's goal)."""
    shape = load_shape("llama-1b" if prefix == "llama1b" else "llama-3-8b")
    shape = dataclasses.replace(shape, num_layers=layers)  # as `toolkit plan --layers`
    lora, c = pl.Lora(8, ("q_proj", "v_proj")), pl.Choice(2, "none", 1.0, 4, 1, False, "speed")
    for q4, name in ((True, f"{prefix}-z2-qlora"), (False, f"{prefix}-z2-lora")):
        p = pl.predict(pl.Workload(shape, 2048, 4, lora, load_in_4bit=q4), c, pl.Hardware(1, 1, 139.0))
        assert p.peak_allocated_gib == pytest.approx(_console(name)[1], rel=0.10), (name, p.peak_allocated_gib)
    if layers == 32:
        (q_tok, q_peak), (b_tok, b_peak) = _console(f"{prefix}-z2-qlora"), _console(f"{prefix}-z2-lora")
        assert q_tok / b_tok >= 0.85 and b_peak - q_peak >= 8.0, (q_tok / b_tok, b_peak - q_peak)


def test_70b_4bit_row_is_planned_within_10_percent() -> None:
    """bench/results/qlora/: Llama-3-70B with a 4-bit base (built quantized, never whole) under LoRA at ZeRO-3 on one
    H200, micro 8 x 2048 with checkpointing: the planned peak within 10% of the console's; and the same workload
    planned for two 80 GiB GPUs fits at ZeRO-3 (the issue's 2-GPU case; not run, no two-GPU kind was lent)."""
    shape, lora = load_shape("llama-3-70b"), pl.Lora(8, ("q_proj", "v_proj"))
    work = pl.Workload(shape, 2048, 8, lora, load_in_4bit=True, quantized_build=True)
    p = pl.predict(work, pl.Choice(3, "none", 1.0, 8, 1, True, "speed"), pl.Hardware(1, 1, 139.0))
    tokens, peak = _console("llama3-70b-z3-qlora-1gpu")
    assert p.peak_allocated_gib == pytest.approx(peak, rel=0.10), (p.peak_allocated_gib, peak)
    assert tokens > 0
    two = pl.predict(dataclasses.replace(work, global_batch=16), pl.Choice(3, "none", 1.0, 8, 1, True, "speed"),
                     pl.Hardware(2, 1, 80.0))
    assert two.peak_allocated_gib < 80 * 0.8, two.peak_allocated_gib
