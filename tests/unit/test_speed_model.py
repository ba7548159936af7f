"""The planner's speed model (issue 50) against what ran on shapes it was not fitted to, the attention rate table, and
train.zero3_leaves' rule. The rows: bench/results/speed_model/validation.json (H200s) and validation_h100.json (4 H100s
of one host), from bench/plan_calibrate.py, re-predicted with the formulas as they are now."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.plan import attention_rates
from toolkit.plan import planner as pl
from toolkit.plan.shapes import load_shape
from toolkit.plan.speedups import leaves_on

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "speed_model"
VALIDATION = RESULTS / "validation.json"
# each file's rows ran on one card kind: the GPU memory its predictions take (bench/plan_calibrate.py repredict)
FILES = {"validation.json": 139.0, "validation_h100.json": 79.0}
# (file, row) -> (speed error allowed, peak error allowed), each explained in bench/results/speed_model/README.md
KNOWN_OFF = {
    # hooks on every submodule with checkpointing: the recompute's hooks are not counted, and the host and the GPU
    # overlap less than max() assumes
    ("validation.json", "lv-l-z3-s2048-m8-ckpt-1gpu-false"): (0.21, 0.05),
    # GPT-2 (hidden 768): the GPU's work is as predicted (profiled: ZeRO-0 busy 118 ms a step against 114 predicted,
    # ZeRO-2 65 against 64), but the step waits on the host: ZeRO-2's GPU was busy 45% of it (2,900 kernel launches,
    # DeepSpeed's per-parameter checks), ZeRO-0's optimizer step syncs 157 times; accumulation shares that out. The
    # host's step below ZeRO-3 (HOST_LAYER_S, fitted on Qwen2-0.5B) takes ZeRO-2's row from +45.7% to -16.7%
    ("validation.json", "v-g2-z2-s1024-m16"): (0.20, 0.05),
    ("validation.json", "v-g2-z0-s1024-m32"): (0.35, 0.05),
    ("validation.json", "v-g2-z0-s1024-m32-a2"): (0.20, 0.05),
    ("validation.json", "v-g2-z2-s1024-m16-a4"): (0.20, 0.05),
    # leaf layers on two GPUs, host-bound: the row the leaf call was first fitted on, one run (0.152 s a step). Three
    # runs of the same row by turns in one lease took 0.208-0.223 s (families/leaf_calls/, where the call is fitted
    # now: +11.5% at their median): a lease's host moves it by a fifth or more
    ("validation.json", "lv-l-z3-s2048-m2-2gpu-true"): (0.22, 0.05),
    # hooks on every submodule, host-bound: ran beside another GPU's queue at 108.5k here, 77.6k (+2.5%) in session 57
    ("validation.json", "v-g2-z3-s1024-m16"): (0.30, 0.05),
    # one rank with hooks is host-bound: the H100 host ran each hook call 1.21x faster than the H200 host it was
    # fitted on
    ("validation_h100.json", "lv-l-z3-s2048-m2-1gpu-false"): (0.18, 0.05),
}


def _predict(c: dict, gpu_mem: float = 139.0) -> pl.Prediction:
    shape = load_shape(c["model"])
    if c.get("layers"):
        shape = dataclasses.replace(shape, num_layers=c["layers"])
    if shape.max_positions is not None:
        shape = dataclasses.replace(shape, max_positions=int(shape.max_positions * c["rope"]))
    leaves = next((e.split("=", 1)[1] for e in c["extra"] if e.startswith("train.zero3_leaves=")), "auto")
    # rows without "chunks" ran before model.liger_chunk_mem_const existed: Liger's own chunks (1)
    w = pl.Workload(shape, c["seq"], c["micro"] * c["accum"] * c["gpus"], None, c["liger"], fused_loss=c["fused_loss"],
                    tiled_mlp=c["tiled"], activation_offload=c["act_offload"], zero3_leaves=leaves,
                    loss_chunks=c.get("chunks", "1"))
    choice = pl.Choice(c["stage"], c["offload"], c["ratio"], c["micro"], c["accum"], c["ckpt"], c["zero_sizes"])
    return pl.predict(w, choice, pl.Hardware(c["gpus"], 1, gpu_mem, 120.0))


@pytest.mark.parametrize("file", sorted(FILES))
def test_every_validation_row_within_15_percent_speed_and_5_percent_peak(file: str) -> None:
    rows = [r for r in json.loads((RESULTS / file).read_text())["rows"] if r["rc"] == 0]
    assert len(rows) >= 12
    for r in rows:
        c, m = r["config"], r["measured"]
        p = _predict(c, FILES[file])
        speed_ok, peak_ok = KNOWN_OFF.get((file, c["name"]), (0.15, 0.05))
        speed = p.tokens_per_s_per_gpu / m["tokens_per_s_per_gpu"] - 1
        assert abs(speed) <= speed_ok, (c["name"], speed)
        for rank in m["per_rank"].values():
            assert abs(p.peak_allocated_gib / rank["peak_allocated_gib"] - 1) <= peak_ok, c["name"]


def test_issue_50_case_both_rows_within_15_percent() -> None:
    rows = {r["config"]["name"]: r for r in json.loads(VALIDATION.read_text())["rows"]}
    for name in ("v-q15-z0-256k", "v-q15-z3all-256k"):
        r = rows[name]
        got = _predict(r["config"]).tokens_per_s_per_gpu
        assert got == pytest.approx(r["measured"]["tokens_per_s_per_gpu"], rel=0.15), name


def test_zero3_on_4_gpus_within_15_percent() -> None:
    """Issue 50 item 4: eager ZeRO-3 (hooks and leaves) on 2 and 4 GPUs of one host."""
    rows = [r for r in json.loads((RESULTS / "validation_h100.json").read_text())["rows"] if r["config"]["gpus"] > 1]
    assert {r["config"]["gpus"] for r in rows} == {2, 4} and len(rows) >= 5
    for r in rows:
        got = _predict(r["config"], 79.0).tokens_per_s_per_gpu
        assert got == pytest.approx(r["measured"]["tokens_per_s_per_gpu"], rel=0.15), r["config"]["name"]


def test_attention_rate_table_interpolates_and_holds_flat_outside() -> None:
    r64, r128 = attention_rates.rate(64, 4096), attention_rates.rate(128, 4096)
    assert r128 > r64 > 0  # head dim 128 runs faster per FLOP on Hopper
    assert min(r64, r128) < attention_rates.rate(96, 4096) < max(r64, r128)
    assert attention_rates.rate(64, 3000) == pytest.approx(
        attention_rates.rate(64, 2048) + (r64 - attention_rates.rate(64, 2048)) * 0.5509, rel=1e-3)  # log2 scale
    assert attention_rates.rate(128, 100) == attention_rates.rate(128, 1024)
    assert attention_rates.rate(512, 10**7) == attention_rates.rate(256, 262144)  # flat past the largest dim
    assert attention_rates.rate(256, 4096) < r128  # head dim 256 (Gemma) measured: slower per FLOP than 128
    assert attention_rates.rate(128, 8192, backward=False) > attention_rates.rate(128, 8192)


def test_leaves_rule() -> None:
    assert leaves_on("auto", stage=2, compiled=False, blocked=None, model_type="llama")[0] is False
    assert leaves_on("auto", stage=3, compiled=False, blocked=None, model_type="qwen2")[0] is True
    assert leaves_on("auto", stage=3, compiled=True, blocked=None, model_type="gpt2")[0] is True
    assert leaves_on("auto", stage=3, compiled=False, blocked=None, model_type="gpt2")[0] is False
    assert leaves_on("auto", stage=3, compiled=False, blocked=None, model_type="llama", objective="grpo")[0] is False
    assert leaves_on("auto", stage=3, compiled=False, blocked="under LoRA", model_type="llama")[0] is False
    assert leaves_on("false", stage=3, compiled=True, blocked=None, model_type="llama")[0] is False
    assert leaves_on("true", stage=3, compiled=False, blocked=None, model_type="gpt2")[0] is True
    with pytest.raises(ValueError, match=r"train\.zero3_leaves=true: under LoRA"):
        leaves_on("true", stage=3, compiled=False, blocked="under LoRA", model_type="llama")


def test_leaf_layers_kept_gathered_with_checkpointing_are_planned_and_warned_of() -> None:
    """With checkpointing DeepSpeed keeps every leaf layer gathered where parameters are partitioned (validation rows
    on 2 and 4 GPUs and the 262K offload row): the plan counts them; where the whole model would take more than half
    the GPU, auto turns leaves off and true warns (resolved.leaves_choice); one rank without offload gathers nothing."""
    from transformers import LlamaConfig

    from toolkit.config.schema import load_config
    from toolkit.plan.speedups import leaves_gathered_gib
    from toolkit.runtime.resolved import leaves_choice

    assert leaves_gathered_gib(10**9, stage=3, grad_ckpt=True, world=1, offload_param=False) == 0.0
    assert leaves_gathered_gib(10**9, stage=3, grad_ckpt=False, world=8, offload_param=False) == 0.0
    assert leaves_gathered_gib(2**30, stage=3, grad_ckpt=True, world=1, offload_param=True) == 2.0
    shape = load_shape("llama-1b")
    w = pl.Workload(shape, 2048, 16, None, True)
    hw = pl.Hardware(2, 1, 139.0, None)
    ckpt, plain = (pl.predict(w, pl.Choice(3, "none", 1.0, 8, 1, ck), hw) for ck in (True, False))
    assert ckpt.gpu["gathered"] == pytest.approx(2 * (shape.embed_numel + shape.num_layers * shape.layer_numel) / pl.GIB)
    assert plain.gpu["gathered"] < ckpt.gpu["gathered"] / 2  # the reuse distance: the head and 4 layers
    ds = {"zero_optimization": {"stage": 3}}
    big = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
    cfg = load_config(None, ["model.gradient_checkpointing=true"])
    # auto: a default never takes what its plan says cannot fit (issue 60), so hooks on every submodule
    on, why = leaves_choice(cfg, ds, False, big, 32, 80 * 2**30)
    assert not on and re.search(r"auto: with checkpointing every leaf layer would stay gathered, 131\.\d GiB on a "
                                r"80 GiB GPU \(more than half\): a hook on each submodule instead", why), why
    # true: kept, with the warning
    on, why = leaves_choice(load_config(None, ["model.gradient_checkpointing=true", "train.zero3_leaves=true"]), ds,
                            False, big, 32, 80 * 2**30)
    assert on and re.search(r"warning: with checkpointing every leaf layer stays gathered, 131\.\d GiB on a 80 GiB "
                            r"GPU: set train\.zero3_leaves=false", why), why
    on, why = leaves_choice(cfg, ds, False, big, 32, 0)  # CPU ranks: the GPU is not known
    assert on and "warning" not in why
    small = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    assert "warning" not in leaves_choice(cfg, ds, False, small, 32, 80 * 2**30)[1]


def test_plan_counts_hooks_where_layers_are_not_leaves() -> None:
    """ZeRO-3 eager: leaves (auto) against a hook on every submodule (false, and LoRA): the hooks' host time."""
    shape = load_shape("llama-1b")
    choice = pl.Choice(3, "none", 1.0, 2, 1, False, "speed")
    hw = pl.Hardware(1, 1, 139.0, None)
    fast = pl.predict(pl.Workload(shape, 2048, 2), choice, hw).tokens_per_s_per_gpu
    slow = pl.predict(pl.Workload(shape, 2048, 2, zero3_leaves="false"), choice, hw).tokens_per_s_per_gpu
    assert fast > 1.5 * slow


def test_the_plan_says_where_its_speeds_were_not_validated() -> None:
    hw1 = pl.Hardware(1, 1, 139.0, None)
    assert pl.speed_caveat(pl.Workload(load_shape("llama-1b"), 2048, 8), hw1) is None
    narrow = pl.speed_caveat(pl.Workload(load_shape("gpt2-124m"), 1024, 8), hw1)
    assert narrow is not None and "hidden 768" in narrow
    assert pl.speed_caveat(pl.Workload(load_shape("qwen2-0.5b"), 4096, 16), hw1) is None  # measured: narrow/
    wide = pl.speed_caveat(pl.Workload(load_shape("llama-1b"), 2048, 16), pl.Hardware(8, 2, 139.0, None))
    assert wide is not None and "16 GPUs on 2 node(s) were not measured" in wide
    assert pl.speed_caveat(pl.Workload(load_shape("llama-1b"), 2048, 12), pl.Hardware(3, 1, 139.0, None)) is not None


# Families traced from their own code (issue 60; bench/results/speed_model/families/README.md): the speed model's
# error per row as measured, where it is outside 15%. Qwen3-4B at ZeRO-3 with DeepSpeed's hook on every submodule (the
# default for these types then; leaf layers now) was measured in three steps, 0.776 and 0.427 s after the first (not run
# again: families/leaf_calls/README.md). Gemma 3's leaf layers at micro 4 at Liger's own loss chunks (not the default)
# overlap host and GPU less than max() assumes, where the leaves' host time (0.364 s a micro-step) and the GPU's work (about
# 0.35 s, its 262K head walked in 128 chunks) are alike: measured 0.48 s (bench/results/speed_model/narrow/README.md).
# On two GPUs Gemma 3's leaf layers at micro 4 wait on the host (0.34-0.54 s a step over its runs): its 13
# modules a layer against llama-1b's 9 (planner.ZERO3_LEAF_MODULES; families/leaf_calls/README.md). Its ZeRO-2 row
# there read +31% until the fused loss's backward lost Liger's synchronize (0.37 s a step, now 0.30: +7.0%;
# ../fused_loss_sync/README.md).
FAMILY_SPEED_OFF = {"f-q3-4b-l12-z3-s4096-m4": 0.47, "f-g3-1b-z3-leaves-s4096-m4": 0.34}


def test_traced_families_peaks_within_10_percent_and_speeds_as_recorded() -> None:
    """Qwen3-4B and Phi-3-mini (12 layers at full width) and Gemma-3-1B, ZeRO-2 and 3 (with hooks on each submodule and
    with leaf layers, the default now), with and without checkpointing, one H200, and on two each family at ZeRO-2 and
    ZeRO-3 (leaf layers), micro 4 and micro 16 with checkpointing: every planned peak within 10% of the measured one
    (Phi-3's on two GPUs read +11.7% until the trace took Liger's RoPE layout); speed within 15% but for the rows
    recorded above. Gemma 3 and llama-1b also at the fused loss's auto chunks (model.liger_chunk_mem_const; rows
    without "chunks" ran Liger's own)."""
    rows = json.loads((RESULTS / "families" / "families.json").read_text())["rows"]
    assert len(rows) == 34 and all(r["rc"] == 0 for r in rows)
    assert {r["config"]["model"] for r in rows} == {"qwen3-4b", "phi3-mini", "gemma3-1b", "llama-1b"}
    two = {(r["config"]["model"], r["config"]["stage"], r["config"]["ckpt"]) for r in rows if r["config"]["gpus"] == 2}
    assert len(two) == 12
    for r in rows:
        c, m = r["config"], r["measured"]
        p = _predict(c)
        for rank in m["per_rank"].values():
            assert abs(p.peak_allocated_gib / rank["peak_allocated_gib"] - 1) <= 0.10, (c["name"], p.peak_allocated_gib)
        speed = p.tokens_per_s_per_gpu / m["tokens_per_s_per_gpu"] - 1
        assert abs(speed) <= FAMILY_SPEED_OFF.get(c["name"], 0.15), (c["name"], speed)


def _one_gpu_errors(file: str, model: str, count: int) -> list[tuple[str, float, float]]:
    """(name, peak error, tokens/s error) of each row of families/`file`: `count` one-GPU rows of `model` that ran."""
    rows = json.loads((RESULTS / "families" / file).read_text())["rows"]
    assert len(rows) == count and all(r["rc"] == 0 and r["config"]["model"] == model for r in rows)
    out = []
    for r in rows:
        c, m = r["config"], r["measured"]
        p = _predict(c)
        out.append((c["name"], p.peak_allocated_gib / m["per_rank"]["0"]["peak_allocated_gib"] - 1,
                    p.tokens_per_s_per_gpu / m["tokens_per_s_per_gpu"] - 1))
    return out


# HRM-Text-1B's rows (families/cycles.json) that plan slower than they ran: at micro 4 its GPU work and the host's
# time, both counted at every layer call (0.68 and 0.71 s a step against 0.60 measured); at ZeRO-3 the hooks on each
# submodule at every call (2.38 s planned, 1.45 s measured: about two calls' worth of a layer's hook time, where the
# planner counts 3.25)
CYCLES_SPEED_OFF = {"f-hrm1b-z2-s2048-m4": 0.17, "f-hrm1b-z3-s2048-m4": 0.40}


def test_layers_run_in_cycles_peaks_within_a_percent_and_speeds_as_recorded() -> None:
    """HRM-Text-1B's shape (two stacks of 16 layers in cycles: 4 calls a layer a forward, 2.5 with gradients), one
    H200, seq 2,048: ZeRO-2 micro 4 and micro 16 with checkpointing, ZeRO-3 micro 4 (a hook on each submodule). The
    peaks, counted at every call (planner.layer_calls), within 1% (-0.1% each); the checkpointed row's speed within
    15% (-1.8%), the others as recorded above."""
    for name, peak, speed in _one_gpu_errors("cycles.json", "hrm-text-1b", 3):
        assert abs(peak) <= 0.01, name
        assert abs(speed) <= CYCLES_SPEED_OFF.get(name, 0.15), (name, speed)


def test_reversible_layers_peaks_within_10_percent_and_speeds_within_15() -> None:
    """A character-level Reformer (reformer-16k: 12 reversible layers, local and LSH attention in turn, rows of
    16,384), ZeRO-2 micro 2 and 8, one H200, eager attention (transformers has no sdpa path for it): the plan holds
    one layer's recompute and its largest part's backward once, whatever the depth (planner.recompute_bytes): peaks
    +3.7% and +7.0% (-10.1% and -15.0% with the MLP's backward term in place of the attention's), tokens/s +10.4% and
    +3.0%."""
    for name, peak, speed in _one_gpu_errors("reversible.json", "reformer-16k", 2):
        assert abs(peak) <= 0.10, name
        assert abs(speed) <= 0.15, name


def test_narrow_rows_within_15_percent_and_the_host_step_below_zero3() -> None:
    """Qwen2-0.5B (hidden 896, 24 layers) at ZeRO-2, 4K to 64K tokens a micro-step, one H200: the steps of micro 1 to 4
    take the host's time (0.19-0.20 s), which the planner counts below ZeRO-3 (HOST_LAYER_S, HOST_STEP_S); every row
    within 15% and its peak within 5%. Without the host's step micro 1 read +187% (bench/results/speed_model/narrow/)."""
    rows = [r for r in json.loads((RESULTS / "narrow" / "calibration.json").read_text())["rows"]
            if r["config"]["name"].startswith("n-q05-")]
    assert len(rows) == 7 and all(r["rc"] == 0 for r in rows)
    for r in rows:
        c, m = r["config"], r["measured"]
        p = _predict(c)
        assert abs(p.tokens_per_s_per_gpu / m["tokens_per_s_per_gpu"] - 1) <= 0.15, (c["name"], p.tokens_per_s_per_gpu)
        assert abs(p.peak_allocated_gib / m["per_rank"]["0"]["peak_allocated_gib"] - 1) <= 0.05, c["name"]
    micro1 = next(r for r in rows if r["config"]["name"] == "n-q05-z2-s4096-m1")
    shape = load_shape("qwen2-0.5b")
    host = shape.num_layers * pl.HOST_LAYER_S + pl.HOST_STEP_S
    assert _predict(micro1["config"]).tokens_per_s_per_gpu == pytest.approx(4096 / host, rel=1e-6)


def test_two_gpu_host_bound_rows() -> None:
    """Qwen2-0.5B on two H200s at 4K-16K tokens a micro-step (and Gemma-3-1B's leaf row again), one run each: peaks
    within 5%, speeds within 15% but Qwen2's leaf layers at micro 1 (+18.6%: 11,987 tokens/s here, three runs in
    another lease 13,220-14,801, families/leaf_calls/). ZeRO-2's steps there take 0.18-0.22 s, a little over one GPU's
    0.19-0.20 (micro 4 +17% until the fused loss's backward lost Liger's synchronize: run again, -2.9%)."""
    rows = json.loads((RESULTS / "narrow" / "calibration_2gpu.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["rc"] == 0 and r["config"]["gpus"] == 2 for r in rows)
    allowed = {"n-q05-z3-leaves-s4096-m1-2gpu": 0.20}
    for r in rows:
        c, m = r["config"], r["measured"]
        p = _predict(c)
        speed = p.tokens_per_s_per_gpu / m["tokens_per_s_per_gpu"] - 1
        assert abs(speed) <= allowed.get(c["name"], 0.15), (c["name"], speed)
        for rank in m["per_rank"].values():
            assert abs(p.peak_allocated_gib / rank["peak_allocated_gib"] - 1) <= 0.05, c["name"]


def test_leaf_calls_by_modules_within_15_percent_of_three_runs_by_turns() -> None:
    """ZeRO-3's leaf layers on two H200s, each row run three times by turns in one lease (families/leaf_calls/): at
    micro 1 four families whose steps wait on the host alone, and the default rows of llama-1b and Gemma-3-1B. Every
    row's median within 15% of the plan. A call's host time grows with the modules that hold the layer's parameters
    (ZERO3_LEAF_MODULES), not its parameter tensors: Qwen2-0.5B's 12 tensors are 9 modules (its q/k/v biases)."""
    import statistics

    runs: dict[str, list[float]] = {}
    configs = {}
    for path in sorted((RESULTS / "families" / "leaf_calls").glob("round_*.json")):
        for r in json.loads(path.read_text())["rows"]:
            assert r["rc"] == 0, r["config"]["name"]
            runs.setdefault(r["config"]["name"], []).append(r["measured"]["tokens_per_s_per_gpu"])
            configs[r["config"]["name"]] = r["config"]
    assert len(runs) == 6 and all(len(v) == 3 for v in runs.values())
    assert {c["model"] for c in configs.values()} == {"llama-1b", "qwen2-0.5b", "qwen3-4b", "gemma3-1b"}
    errors = {}
    for name, v in runs.items():
        errors[name] = _predict(configs[name]).tokens_per_s_per_gpu / statistics.median(v) - 1
        assert abs(errors[name]) <= 0.15, (name, errors[name])
    # the README's table comes from bench/leaf_calls.py: the same medians and errors
    files = sorted(str(p) for p in (RESULTS / "families" / "leaf_calls").glob("round_*.json"))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "leaf_calls.py"), *files], capture_output=True,
                         text=True, check=True).stdout
    table = {r["row"]: r for r in map(json.loads, out.splitlines())}
    assert table.keys() == errors.keys()
    assert all(table[n]["error"] == pytest.approx(e, abs=1e-4) for n, e in errors.items())
    qwen2, llama, gemma = (load_shape(m) for m in ("qwen2-0.5b", "llama-1b", "gemma3-1b"))
    assert (llama.layer_modules, qwen2.layer_modules, gemma.layer_modules) == (pl.ZERO3_LEAF_MODULES, 9, 13)
    assert len(qwen2.layer_params) == 12
    assert pl._leaf_s(2, gemma.layer_modules) == pytest.approx(pl.ZERO3_LEAF_S[2] * 13 / 9)
    assert pl._leaf_s(1, gemma.layer_modules) == pl.ZERO3_LEAF_S[1]


def test_the_fused_loss_time_fits_its_measured_rows() -> None:
    """planner.fused_loss_s against bench/fused_loss.py's 180 rows (six heads, 2,048-65,536 tokens, chunk_mem_const
    1-32, one H200): within 12% of every row of at least 4 ms (Phi-3's smaller heads run a launch-bound few ms), and
    the auto chunks within 6% of the fastest measured chunking of each shape and length where the bench ran them (auto
    asks more than chunk_mem_const 32 of the shortest micro-batches of the widest vocabularies)."""
    rows = json.loads((RESULTS / "fused_loss_h200.json").read_text())["rows"]
    assert len(rows) >= 150
    best: dict[tuple[int, int, int], float] = {}
    for r in rows:
        key = (r["hidden"], r["vocab"], r["tokens"])
        best[key] = min(best.get(key, r["s"]), r["s"])
        assert pl.loss_chunk_rows(r["tokens"], r["hidden"], r["vocab"], r["chunk_mem_const"]) == r["chunk_rows"]
        if r["s"] >= 0.004:
            predicted = pl.fused_loss_s(r["tokens"], r["hidden"], r["vocab"], r["chunk_mem_const"])
            assert abs(predicted / r["s"] - 1) <= 0.12, (r["shape"], r["tokens"], r["chunk_mem_const"])
    measured = 0
    for (h, v, t), fastest in best.items():
        auto = pl.loss_chunk_const("auto", tokens=t, hidden=h, vocab=v)
        ran = [r["s"] for r in rows if (r["hidden"], r["vocab"], r["tokens"]) == (h, v, t)
               and r["chunk_rows"] == pl.loss_chunk_rows(t, h, v, auto)]
        if ran:
            measured += 1
            assert ran[0] <= 1.06 * fastest, (h, v, t)
    assert measured >= 28


def test_stacks_of_their_own_widths_peaks_within_a_percent_and_speeds_as_recorded() -> None:
    """BLT-1B's shape without its patcher (blt-1b-bytes: every byte a patch, its global stack over the whole row; a
    one-layer local encoder, 25 global layers at width 2,048, nine local decoder layers with cross-attention, 3.07B
    parameters of hash embeddings), ZeRO-2, seq 4,096, one H200: the peaks at micro 2 (the optimizer step), micro 4
    and micro 16 with checkpointing (the top layer's backward; a checkpointed layer keeps what its cross-attention saves
    beside it) within 1% (-0.1%, -0.5%, +0.5%). Its tokens/s at micro 16 within 2%; at micro 2 and 4 planned 33% and
    20% fast: both steps took 0.13 s more than planned, a per-step cost the plan lacks (not traced); the plan's speed
    caveat says so."""
    errors = _one_gpu_errors("stacks.json", "blt-1b-bytes", 3)
    for name, peak, speed in errors:
        assert abs(peak) <= 0.01, name
        assert abs(speed) <= (0.15 if name.endswith("-ckpt") else 0.35), (name, speed)
