"""Calibration of `toolkit plan`: predicted vs measured per-rank peak GPU memory and host RSS.

Every configuration runs toolkit/train.py in its own process through the real `deepspeed` launcher
(raw path, bf16, a few steps, a memory snapshot every step) with the planner's prediction copied into
its run directory as plan.json, so `toolkit report RUN` shows the same comparison per rank.

    # the calibration set: 12 one-GPU configurations, 2 on 2 GPUs and 2 on 4 (skipped where fewer GPUs exist)
    source .whl/setup.sh && python bench/plan_calibrate.py run --out /tmp/cal
        -> /tmp/cal/calibration.json and /tmp/cal/calibration.md (copy both to bench/results/)
    # the largest full fine-tune on one GPU: what `toolkit plan` chooses for Llama-3-8B on one H200
    # with 125 GiB of host RAM, run with ./launch.sh --plan for 10 steps
    source .whl/setup.sh && python bench/plan_calibrate.py bigrun --out /tmp/big
        [--model llama-2-7b --global-batch 8]   # the 6.7B shape of issue 11 (3,180 tokens/s to beat)
    # CPU smoke test of this script (tests/dist/test_plan_calibrate.py): tiny model, 2 CPU ranks
    python bench/plan_calibrate.py run --smoke --out /tmp/smoke
    # the stored measurements against the planner as it is now (no GPU; after a formula change)
    python bench/plan_calibrate.py repredict bench/results/calibration/calibration.json

Device commands and time (the device machine allows 10 minutes per command; carry [".whl"]):
  run on nvidia-h200 (1 GPU, 139 GiB): about 6-7 minutes: op builds ~1.5 min, then 12 one-GPU
    configurations three at a time (`--lanes 3`; each process's allocator peak is its own, so sharing
    a GPU does not change what is measured; NVML figures are then the device's and are marked shared).
  run on nvidia-h200-x2: the same 12 one-GPU configurations on both GPUs plus two on 2 GPUs, ~6 minutes.
  run --only l-z2-s512-m4-4gpu,l-z3-s512-m4-4gpu on nvidia-h200-x4: ZeRO-2 vs ZeRO-3 per rank on 4 GPUs
    (issue 11 item 4; the planner predicts ZeRO-3 lower), ~3 minutes.
  bigrun on nvidia-h200: about 5 minutes (op build ~1 min, 8B random init ~1 min, 10 steps of ~10 s).
  bigrun --gpus 4 --global-batch 64 --host-mem 500 on nvidia-h100-x4: the 8B shape across 4 GPUs (--gpu-mem: the card's).
Each configuration has its own --timeout (default 240 s); one that fails is recorded with its rc and
the tail of its log, and the others still run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _proc import call_group  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.plan import planner as pl  # noqa: E402  (pure: no torch)
from toolkit.plan.command import candidate_json, ds_config_for  # noqa: E402
from toolkit.plan.shapes import load_shape  # noqa: E402

GPU_TOLERANCE = 0.10  # issue 11: at most 10% of the measured per-rank peak
HOST_TOLERANCE = 0.15  # and 15% for host RAM


@dataclass(frozen=True)
class Config:
    name: str
    model: str
    seq: int
    micro: int
    accum: int
    stage: int
    offload: pl.Offload = "none"
    ratio: float = 1.0
    gpus: int = 1
    ckpt: bool = False
    lora: bool = False
    liger: bool = True
    zero_sizes: str = "speed"
    fused_loss: str = "auto"
    extra: tuple[str, ...] = field(default_factory=tuple)
    tiled: bool = False
    """model.tiled_mlp=true (else false)."""
    rope: float = 1.0
    """model.rope_factor: the model's positions x this (long sequences)."""
    layers: int = 0
    """model.num_layers: a preset at full width with this many decoder layers (0: its own)."""
    act_offload: str = "false"
    """model.activation_offload (false for the rows measured before it existed)."""
    sp: int = 1
    """train.sequence_parallel: the ranks of a group share each sequence (global batch micro x accum x gpus / sp)."""
    chunks: str = "1"
    """model.liger_chunk_mem_const: 1, Liger's own chunks, for every row measured before the setting existed (its
    auto default since 2026-11-29); rows of a calibration.json without the key ran at 1."""

    def choice(self) -> pl.Choice:
        return pl.Choice(self.stage, self.offload, self.ratio, self.micro, self.accum, self.ckpt, self.zero_sizes)


Q, L = "qwen2-0.5b", "llama-1b"
# Two models; ZeRO-0 to 3; optimizer and parameter offload (and a partial offload ratio); micro 2/4/8;
# sequences 512/1024/2048; checkpointing; LoRA; Liger on and off, its fused loss on and off at ZeRO-3;
# speed and memory ZeRO sizes.
CONFIGS: tuple[Config, ...] = (
    Config("q-z0-s512-m4", Q, 512, 4, 2, 0),
    Config("q-z1-s1024-m8", Q, 1024, 8, 1, 1),
    Config("q-z2-s1024-m8-noliger", Q, 1024, 8, 1, 2, liger=False),
    Config("q-z3-s1024-m4-nofused", Q, 1024, 4, 2, 3, fused_loss="false"),
    Config("q-z2off-s1024-m8", Q, 1024, 8, 1, 2, "optimizer"),
    Config("q-z3all-s1024-m4", Q, 1024, 4, 1, 3, "all"),
    Config("q-z2-lora-s2048-m4", Q, 2048, 4, 1, 2, lora=True),
    Config("l-z2-s2048-m4-ckpt", L, 2048, 4, 2, 2, ckpt=True),
    Config("l-z3-s2048-m2", L, 2048, 2, 2, 3),
    Config("l-z3off-r0.5-s1024-m4", L, 1024, 4, 1, 3, "optimizer", 0.5),
    Config("l-z2-s512-m8-noliger-mem", L, 512, 8, 1, 2, liger=False, zero_sizes="memory"),
    Config("l-z3-lora-ckpt-s2048-m8", L, 2048, 8, 1, 3, ckpt=True, lora=True),
    Config("l-z2-s1024-m8-2gpu", L, 1024, 8, 1, 2, gpus=2),
    Config("l-z3-s1024-m8-2gpu", L, 1024, 8, 1, 3, gpus=2),
    # issue 11 item 4: ZeRO-3 below ZeRO-2 per rank from 3 ranks on, on anatomy.md's workload (4 GPUs)
    Config("l-z2-s512-m4-4gpu", L, 512, 4, 1, 2, gpus=4, liger=False, zero_sizes="memory"),
    Config("l-z3-s512-m4-4gpu", L, 512, 4, 1, 3, gpus=4, liger=False, zero_sizes="memory"),
)
# Long sequences (issue 35), one sequence per step, run with --only (not in the default set): llama-3.2-1b (131,072
# positions, x8 by rope scaling), checkpointing on, tiled MLPs from 64K as the run's auto would, ZeRO-2.
LONG: tuple[Config, ...] = (
    *(Config(f"ls-1b-z2-{n // 1024}k", "llama-3.2-1b", n, 1, 1, 2, ckpt=True, tiled=n >= 65536, rope=8.0)
      for n in (32768, 65536, 131072, 262144)),
    # 512K: above one H100 at ZeRO-2 by the planner; ZeRO-3 with optimizer and parameters on the CPU is its choice
    Config("ls-1b-z3all-512k", "llama-3.2-1b", 524288, 1, 1, 3, "all", ckpt=True, tiled=True, rope=8.0),
    # checkpointed inputs offloaded (model.activation_offload): against the same run without it, 256K at ZeRO-2
    Config("ls-1b-z2-256k-pinned", "llama-3.2-1b", 262144, 1, 1, 2, ckpt=True, tiled=True, rope=8.0,
           act_offload="pinned"),
    # the Llama-3-8B shape with LoRA at 384K in 8 of its 32 layers (a whole step of 32 layers outlasts a device
    # command): each layer's working set and input as in the full model; inputs pageable, as the full model's would be
    *(Config(f"ls-8b-lora-l8-384k-{a}", "llama-3.1-8b", 393216, 1, 1, 2, ckpt=True, tiled=True, rope=8.0, lora=True,
             layers=8, act_offload=a) for a in ("pageable", "false")),
    # the whole Llama-3-8B shape with LoRA at 384K, the run's own choices (activation_offload=auto: pageable inputs)
    Config("ls-8b-lora-384k", "llama-3.1-8b", 393216, 1, 1, 2, ckpt=True, tiled=True, rope=8.0, lora=True,
           act_offload="auto"),
    # 512K for the 1B shape at ZeRO-2 (no parameter or optimizer offload) with its inputs on the CPU (auto: pinned)
    Config("ls-1b-z2-512k", "llama-3.2-1b", 524288, 1, 1, 2, ckpt=True, tiled=True, rope=8.0, act_offload="auto"),
)
# Shapes the speed model was not fitted on (issue 50), run with --only: Qwen2.5-1.5B (head dim 128, GQA 6:1), Qwen2.5-3B
# (128, 8:1), Mistral-7B at full width in 8 of its 32 layers (128, 4:1), GPT-2; short and long rows, ZeRO-0/2/3 and
# offload.
# The issue's own case first: Qwen2.5-1.5B at 262,144 tokens, its two choices (ZeRO-0; ZeRO-3 with all on the CPU).
Q15, Q3, M7, G2 = "qwen2.5-1.5b", "qwen2.5-3b", "mistral-7b", "gpt2-124m"
# The ZeRO-3 rows ran (run s56) when eager layers kept DeepSpeed's hook on each submodule by default; today that is
# train.zero3_leaves=false.
HOOKS = ("train.zero3_leaves=false",)
VALIDATE: tuple[Config, ...] = (
    Config("v-q15-z0-256k", Q15, 262144, 1, 1, 0, ckpt=True, tiled=True, rope=16.0),
    Config("v-q15-z3all-256k", Q15, 262144, 1, 1, 3, "all", ckpt=True, tiled=True, rope=16.0, extra=HOOKS),
    Config("v-q15-z2-s4096-m4", Q15, 4096, 4, 1, 2),
    Config("v-q15-z3-s4096-m4", Q15, 4096, 4, 1, 3, extra=HOOKS),
    Config("v-q15-z0-s2048-m8", Q15, 2048, 8, 1, 0),
    Config("v-q15-z2-32k", Q15, 32768, 1, 1, 2, ckpt=True),
    Config("v-q15-z2opt-s4096-m4", Q15, 4096, 4, 1, 2, "optimizer"),
    Config("v-q3-z2-s4096-m2", Q3, 4096, 2, 1, 2),
    Config("v-q3-z3-s8192-m1", Q3, 8192, 1, 1, 3),
    Config("v-q3-z3-64k", Q3, 65536, 1, 1, 3, ckpt=True, tiled=True, rope=2.0, extra=HOOKS),
    Config("v-m7l8-z2-s2048-m4", M7, 2048, 4, 1, 2, layers=8),
    Config("v-m7l8-z3-s4096-m2", M7, 4096, 2, 1, 3, layers=8),
    Config("v-m7l8-z2-32k", M7, 32768, 1, 1, 2, ckpt=True, layers=8),
    Config("v-m7l8-z3opt-s2048-m4", M7, 2048, 4, 1, 3, "optimizer", layers=8),
    # GPT-2 (124M: LayerNorm, GELU, 12 heads of 64, no GQA, hidden 768), at its 1,024 positions
    Config("v-g2-z2-s1024-m16", G2, 1024, 16, 1, 2),
    Config("v-g2-z3-s1024-m16", G2, 1024, 16, 1, 3),
    Config("v-g2-z0-s1024-m32", G2, 1024, 32, 1, 0),
    # session 58: the same with accumulation (the optimizer step's share of a step), and llama-1b's ZeRO-2 step so;
    # the 262K offload row as leaf modules, today's default for it
    Config("v-g2-z2-s1024-m16-a4", G2, 1024, 16, 4, 2),
    Config("v-g2-z0-s1024-m32-a2", G2, 1024, 32, 2, 0),
    Config("v-l-z2-s2048-m8", L, 2048, 8, 1, 2),
    Config("v-l-z2-s2048-m8-a4", L, 2048, 8, 4, 2),
    Config("v-q15-z3all-256k-leaves", Q15, 262144, 1, 1, 3, "all", ckpt=True, tiled=True, rope=16.0),
)
# ZeRO-3 with the decoder layers as leaf modules without compile (train.zero3_leaves=true) against DeepSpeed's hook on
# every submodule (issue 50 item 4): llama-1b at small micro-batches, on 1, 2 and 4 GPUs, with and without checkpointing.
LEAVES: tuple[Config, ...] = (
    *(Config(f"lv-l-z3-s2048-m{m}{'-ckpt' * ck}-{g}gpu-{lv}", L, 2048, m, 1, 3, gpus=g, ckpt=ck,
             extra=(f"train.zero3_leaves={lv}", "train.compile=off"))
      for g in (1, 2, 4) for m, ck in ((2, False), (8, True)) for lv in ("false", "true")),
    Config("lv-q15-z3-s4096-m4-1gpu-true", Q15, 4096, 4, 1, 3, extra=("train.zero3_leaves=true", "train.compile=off")),
)
# Families the planner knows only from their own code (issue 60, toolkit/plan/trace.py), run with --only: Qwen3-4B and
# Phi-3-mini at full width in 12 of their layers, Gemma-3-1B whole; seq 4,096, ZeRO-2 and ZeRO-3, with and without
# checkpointing, one GPU. Their ZeRO-3 rows ran with a hook on each submodule, then these types' default: HOOKS keeps
# the names running what their rows in families.json ran (leaf layers, the default now, are FAMILY_LEAVES).
Q3_4, P3, GM3 = "qwen3-4b", "phi3-mini", "gemma3-1b"
FAMILIES: tuple[Config, ...] = tuple(
    Config(f"f-{tag}-z{stage}-s4096-m{m}{'-ckpt' * ck}", model, 4096, m, 1, stage, ckpt=ck, layers=layers,
           extra=HOOKS if stage == 3 else ())
    for tag, model, layers in (("q3-4b-l12", Q3_4, 12), ("p3-l12", P3, 12), ("g3-1b", GM3, 0))
    for stage in (2, 3) for m, ck in ((4, False), (16, True)))
# the same families at ZeRO-3 with their decoder layers as leaf modules (train.zero3_leaves=true): one gather and one
# reduce a layer, against a hook on each submodule above (EAGER_LEAVES_TYPES)
FAMILY_LEAVES: tuple[Config, ...] = tuple(
    Config(f"f-{tag}-z3-leaves-s4096-m{m}{'-ckpt' * ck}", model, 4096, m, 1, 3, ckpt=ck, layers=layers,
           extra=("train.zero3_leaves=true",))
    for tag, model, layers in (("q3-4b-l12", Q3_4, 12), ("p3-l12", P3, 12), ("g3-1b", GM3, 0))
    for m, ck in ((4, False), (16, True)))
# two GPUs of one host, each rank its micro-batch, at today's defaults (ZeRO-3 at train.zero3_leaves=auto: leaf layers
# for these types; the fused loss's auto chunks): every family, ZeRO-2 and ZeRO-3, with and without checkpointing
FAMILY_2GPU: tuple[Config, ...] = tuple(
    Config(f"f-{tag}-z{stage}-s4096-m{m}{'-ckpt' * ck}-2gpu", model, 4096, m, 1, stage, gpus=2, ckpt=ck,
           layers=layers, chunks="auto")
    for tag, model, layers in (("q3-4b-l12", Q3_4, 12), ("p3-l12", P3, 12), ("g3-1b", GM3, 0))
    for stage in (2, 3) for m, ck in ((4, False), (16, True)))
# Gemma 3's rows again at the fused loss's auto chunks of 2,048 rows (the default since 2026-11-29; the rows above ran
# Liger's own, 128 chunks whatever the micro-batch), and llama-1b's at both: the same command holds both sides
FAMILY_CHUNKS: tuple[Config, ...] = (
    *(Config(f"f-g3-1b-{z}-s4096-m{m}{'-ckpt' * ck}-chunks", GM3, 4096, m, 1, stage, ckpt=ck, chunks="auto",
             extra=extra)
      for z, stage, extra in (("z2", 2, ()), ("z3-leaves", 3, ("train.zero3_leaves=true",)))
      for m, ck in ((4, False), (16, True))),
    *(Config(f"f-l-z2-s2048-m8-chunks-{c}", L, 2048, 8, 1, 2, chunks=c) for c in ("1", "auto")),
)
# A second narrow shape for the width term of the speed model (issue 60): Qwen2-0.5B (hidden 896) at ZeRO-2, seq 4,096,
# 4K to 64K tokens a micro-step, one micro-step a step (and micro 4 with four), the defaults of 2026-11-29 (the fused
# loss's auto chunks, no training cache)
NARROW: tuple[Config, ...] = (
    *(Config(f"n-q05-z2-s4096-m{m}", Q, 4096, m, 1, 2, chunks="auto") for m in (1, 2, 4, 8, 16)),
    Config("n-q05-z2-s4096-m4-a4", Q, 4096, 4, 4, 2, chunks="auto"),
    Config("n-q05-z3-leaves-s4096-m4", Q, 4096, 4, 1, 3, chunks="auto", extra=("train.zero3_leaves=true",)),
    # the same host-bound steps on two GPUs of one host (2026-11-29, fifth session)
    *(Config(f"n-q05-z2-s4096-m{m}-2gpu", Q, 4096, m, 1, 2, gpus=2, chunks="auto") for m in (1, 2, 4)),
    *(Config(f"n-q05-z3-leaves-s4096-m{m}-2gpu", Q, 4096, m, 1, 3, gpus=2, chunks="auto",
             extra=("train.zero3_leaves=true",)) for m in (1, 4)),
)
# A leaf layer's host time a call on two GPUs (issue 60), run by turns in one lease
# (bench/results/speed_model/families/leaf_calls/): llama-1b, Gemma-3-1B and Qwen3-4B (12 layers at full width) at
# micro 1 x 1,024, where the GPU's work is a few milliseconds a layer and each step waits on the host's leaf calls,
# beside Qwen2-0.5B's micro 1 (above) and the default rows of llama-1b and Gemma-3-1B
LEAF_CALLS: tuple[Config, ...] = tuple(
    Config(f"f-{tag}-z3-s1024-m1-2gpu", model, 1024, 1, 1, 3, gpus=2, layers=layers, chunks="auto")
    for tag, model, layers in (("l", L, 0), ("g3-1b", GM3, 0), ("q3-4b-l12", Q3_4, 12)))
# HRM-Text-1B's shape (issue 60): layers run several times a forward (planner.layer_calls), ZeRO-2 with and without
# checkpointing and ZeRO-3, seq 2,048 (its positions), one GPU, today's defaults
HRM = "hrm-text-1b"
FAMILY_CYCLES: tuple[Config, ...] = (
    Config("f-hrm1b-z2-s2048-m4", HRM, 2048, 4, 1, 2, chunks="auto"),
    Config("f-hrm1b-z2-s2048-m16-ckpt", HRM, 2048, 16, 1, 2, ckpt=True, chunks="auto"),
    Config("f-hrm1b-z3-s2048-m4", HRM, 2048, 4, 1, 3, chunks="auto"),
)
# a Reformer's reversible layers (planner.recompute_bytes): one layer's recompute held in backward whatever the depth;
# ZeRO-2, rows of 16,384 (its one training length), micro 2 and 8, one GPU
REFORMER = "reformer-16k"
FAMILY_REVERSIBLE: tuple[Config, ...] = tuple(
    Config(f"f-ref16k-z2-s16384-m{m}", REFORMER, 16384, m, 1, 2, chunks="auto") for m in (2, 8))
# stacks of their own widths (BLT-1B's shape, every byte a patch): the global stack over the whole row; ZeRO-2, one GPU
BLT = "blt-1b-bytes"
FAMILY_STACKS: tuple[Config, ...] = (
    *(Config(f"f-blt1b-bytes-z2-s4096-m{m}", BLT, 4096, m, 1, 2, chunks="auto") for m in (2, 4)),
    # checkpointed: each layer keeps its input and what its cross-attention saves beside it (not run again)
    Config("f-blt1b-bytes-z2-s4096-m16-ckpt", BLT, 4096, 16, 1, 2, ckpt=True, chunks="auto"),
)
SMOKE: tuple[Config, ...] = (
    Config("tiny-z2", "tiny", 64, 2, 2, 2, gpus=2),
    Config("tiny-z3all", "tiny", 64, 2, 1, 3, "all", gpus=2),
)


def workload(c: Config) -> pl.Workload:
    """The planner's Workload for a configuration (the model's positions x its rope factor, as `toolkit plan`)."""
    shape = load_shape(c.model)
    if c.layers:
        shape = dataclasses.replace(shape, num_layers=c.layers)
    if shape.max_positions is not None:
        shape = dataclasses.replace(shape, max_positions=int(shape.max_positions * c.rope))
    leaves = next((e.split("=", 1)[1] for e in c.extra if e.startswith("train.zero3_leaves=")), "auto")
    return pl.Workload(shape, c.seq, c.micro * c.accum * c.gpus // c.sp, pl.Lora() if c.lora else None, c.liger,
                       fused_loss=c.fused_loss, tiled_mlp=c.tiled, activation_offload=c.act_offload,
                       sequence_parallel=c.sp, zero3_leaves=leaves, loss_chunks=c.chunks)


def predict(c: Config, gpu_mem_gib: float, cpu: bool, host_mem_gib: float = 0.0) -> pl.Prediction:
    w = workload(c)
    # the host matters where activation_offload=auto chooses pinned or pageable buffers against it, as the run does
    return pl.predict(w, c.choice(), pl.Hardware(c.gpus, 1, gpu_mem_gib, host_mem_gib or None, cpu_ranks=cpu))


def plan_record(c: Config, p: pl.Prediction, command: str) -> dict[str, Any]:
    """A plan.json for the run directory, so `toolkit report` shows this prediction beside the run."""
    return {"plan_version": 1, "command": command,
            "inputs": {"model": c.model, "seq_len": c.seq, "global_batch": c.micro * c.accum * c.gpus // c.sp,
                       "gpus_per_node": c.gpus, "nodes": 1, "world_size": c.gpus},
            "candidates": [candidate_json(p)],
            "chosen": candidate_json(p) | {"phase": p.phase, "gpu_breakdown_gib": p.gpu,
                                           "persistent_gib": p.persistent, "host_rank_gib": p.host_rank_gib,
                                           "host_breakdown_gib": p.host, "ds_config": ds_config_for(p.choice)}}


def _overrides(c: Config, steps: int, run_dir: Path, plan_file: Path, smoke: bool, gpu_limit: float = 0.0) -> list[str]:
    o = [f"model.name={c.model}", f"data.seq_len={c.seq}",
         f"data.num_samples={c.micro * c.accum * c.gpus // c.sp * (steps + 1)}", f"train.micro_batch_size={c.micro}",
         f"train.grad_accum={c.accum}", f"train.max_steps={steps}", "train.path=raw", "train.export=false",
         "train.warmup_steps=1", "memory.every=1", "metrics.tensorboard=false", f"train.zero_sizes={c.zero_sizes}",
         f"model.gradient_checkpointing={str(c.ckpt).lower()}", f"model.liger={str(c.liger).lower()}",
         f"lora.enabled={str(c.lora).lower()}", f"model.liger_fused_loss={c.fused_loss}",
         f"train.run_dir={run_dir}", f"train.plan={plan_file}", f"model.tiled_mlp={str(c.tiled).lower()}",
         f"model.rope_factor={c.rope:g}", f"model.activation_offload={c.act_offload}",
         f"model.liger_chunk_mem_const={c.chunks}", *c.extra]
    if c.layers:
        o.append(f"model.num_layers={c.layers}")
    if gpu_limit:
        o.append(f"memory.gpu_limit_gib={gpu_limit:g}")
    if c.sp > 1:
        o.append(f"train.sequence_parallel={c.sp}")
    if not smoke:
        o.append("train.precision=bf16")
    return o


def measure(run_dir: Path) -> dict[str, Any]:
    """Per-rank peaks over the whole run (a snapshot's peak covers the window since the previous one)."""
    ranks: dict[str, dict[str, float | None]] = {}
    for f in sorted((run_dir / "memory").glob("rank*.jsonl")):
        snaps = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        def top(key: str, snaps: list[dict[str, Any]] = snaps) -> float | None:
            vals = [s[key] for s in snaps if s.get(key) is not None]
            return max(vals) if vals else None
        rank = f.stem.removeprefix("rank")
        ranks[rank] = {"peak_allocated_gib": top("peak_allocated_gib"), "peak_reserved_gib": top("peak_reserved_gib"),
                       "nvml_used_gib": top("nvml_used_gib"), "host_rss_gib": top("host_rss_gib")}
        b = run_dir / "memory" / f"breakdown_rank{rank}.json"
        if b.is_file():
            ranks[rank]["breakdown"] = json.loads(b.read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    later = [m["tokens_per_s"] for m in metrics[1:] if m.get("tokens_per_s")]
    return {"per_rank": ranks, "losses": [m["loss"] for m in metrics],
            "step_times_s": [m.get("step_time_s") for m in metrics],
            "tokens_per_s_per_gpu": statistics.median(later) / max(1, len(ranks)) if later else None}


def _err(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas


def run_one(c: Config, out: Path, steps: int, port: int, include: str | None, smoke: bool, gpu_mem: float,
            timeout: int, shared_gpu: bool, gpu_limit: float = 0.0, host_mem: float = 0.0) -> dict[str, Any]:
    p = predict(c, gpu_mem, smoke, host_mem)
    ds_file, plan_file, run_dir = out / "ds" / f"{c.name}.json", out / "plans" / f"{c.name}.json", out / "runs" / c.name
    for d in (ds_file.parent, plan_file.parent, run_dir.parent):
        d.mkdir(parents=True, exist_ok=True)
    ds_file.write_text(json.dumps(ds_config_for(c.choice()), indent=1))
    launch = ["deepspeed", "--master_port", str(port)]
    launch += ["--include", include] if include else ["--num_gpus", str(c.gpus)]
    cmd = [*launch, "toolkit/train.py", "--ds", str(ds_file), *_overrides(c, steps, run_dir, plan_file, smoke, gpu_limit)]
    plan_file.write_text(json.dumps(plan_record(c, p, " ".join(cmd)), indent=1))
    env = dict(os.environ) | {"PYTHONUNBUFFERED": "1"}
    if smoke:
        env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    log = out / "logs" / f"{c.name}.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as f:
        rc = call_group(cmd, ROOT, env, f, timeout)
    row: dict[str, Any] = {"config": c.__dict__ | {"extra": list(c.extra)}, "rc": rc,
                           "wall_s": round(time.perf_counter() - t0, 1), "argv": " ".join(cmd),
                           "shared_gpu": shared_gpu}
    try:
        row["measured"] = measure(run_dir)
    except (OSError, ValueError, KeyError) as e:
        row["measured"] = None
        row["error"] = f"{type(e).__name__}: {e}"
    if rc != 0:
        row["log_tail"] = log.read_text()[-3000:]
    _set_prediction(row, p)
    return row


def _set_prediction(row: dict[str, Any], p: pl.Prediction) -> None:
    """The row's predicted block and its errors against the row's measured peaks (every rank's)."""
    row["predicted"] = {"peak_allocated_gib": p.peak_allocated_gib, "gpu_need_gib": p.gpu_need_gib,
                        "phase": p.phase, "gpu_gib": p.gpu, "persistent_gib": p.persistent,
                        "host_rank_gib": p.host_rank_gib, "host_gib": p.host,
                        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                        "liger": p.liger, "fused_loss": p.fused_loss}
    if row.get("measured"):
        per = row["measured"]["per_rank"].values()
        gpu = [r["peak_allocated_gib"] for r in per if r.get("peak_allocated_gib") is not None]
        host = [r["host_rss_gib"] for r in per if r.get("host_rss_gib") is not None]
        row["gpu_error"] = max((_err(p.peak_allocated_gib, m) for m in gpu), key=abs, default=None)
        row["host_error"] = max((_err(p.host_rank_gib, m) for m in host), key=abs, default=None)


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _write(out: Path, a: argparse.Namespace, gpus: int, smoke: bool, t0: float, skipped: list[str],
           rows: list[dict[str, Any]]) -> dict[str, Any]:
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/plan_calibrate.py " + " ".join(sys.argv[1:]), "gpus": gpus,
              "device": _device_name(), "smoke": smoke, "wall_s": round(time.perf_counter() - t0, 1),
              "skipped_need_more_gpus": skipped, "rows": rows}
    (out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "calibration.md").write_text(table(result))
    return result


def cmd_run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke = a.smoke
    configs = SMOKE if smoke else CONFIGS
    if a.only:
        wanted = a.only.split(",")
        every = (CONFIGS + LONG + VALIDATE + LEAVES + FAMILIES + FAMILY_LEAVES + FAMILY_2GPU + FAMILY_CHUNKS + NARROW
                 + FAMILY_CYCLES + FAMILY_REVERSIBLE + FAMILY_STACKS + LEAF_CALLS)
        configs = tuple(c for c in (SMOKE if smoke else every) if c.name in wanted)
        configs = tuple(sorted(configs, key=lambda c: wanted.index(c.name)))  # in the order asked
    if a.set:  # e.g. train.stop_after=1, then train.resume=latest: a run longer than one device command
        configs = tuple(dataclasses.replace(c, extra=(*c.extra, *a.set)) for c in configs)
    gpus = 2 if smoke else (a.gpus or _gpu_count())
    if not smoke and gpus == 0:
        print("error: no GPU found (nvidia-smi); use --smoke for the CPU test of this script", file=sys.stderr)
        return 1
    if not smoke:
        # one build of DeepSpeed's ops before the runs start in parallel (bench/prebuild_ops.py)
        ops = ["fused_adam"] + (["cpu_adam"] if any(c.offload != "none" for c in configs) else [])
        subprocess.call([sys.executable, "bench/prebuild_ops.py", *ops], cwd=ROOT)
    skipped = [c.name for c in configs if c.gpus > gpus]
    singles = [c for c in configs if c.gpus == 1 and c.gpus <= gpus]
    multis = [c for c in configs if c.gpus > 1 and c.gpus <= gpus]
    rows: list[dict[str, Any]] = []
    port = a.port
    lanes = max(1, a.lanes)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(lanes) as pool:
        futures = []
        for i, c in enumerate(singles):
            include = None if smoke else f"localhost:{a.device if a.device is not None else i % gpus}"
            futures.append(pool.submit(run_one, c, out, a.steps, port + i, include, smoke, a.gpu_mem, a.timeout,
                                       lanes > gpus, a.gpu_limit, a.host_mem))
        for fut in futures:
            rows.append(fut.result())
            _progress(rows[-1])
            _write(out, a, gpus, smoke, t0, skipped, rows)  # after every row: a cut-off run keeps what it measured
    for j, c in enumerate(multis):  # every GPU at once: alone
        rows.append(run_one(c, out, a.steps, port + len(singles) + j, None, smoke, a.gpu_mem, a.timeout, False,
                            a.gpu_limit, a.host_mem))
        _progress(rows[-1])
        _write(out, a, gpus, smoke, t0, skipped, rows)
    result = _write(out, a, gpus, smoke, t0, skipped, rows)
    print(table(result))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def _device_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{len(out)}x {out[0]}" if out else None


def _progress(row: dict[str, Any]) -> None:
    c = row["config"]
    print(f"{c['name']}: rc={row['rc']} {row['wall_s']:.0f}s gpu error {_pct(row.get('gpu_error'))} "
          f"host error {_pct(row.get('host_error'))}", flush=True)
    if row["rc"] != 0:  # the cause, where a caller sees only the output (CI's failed test)
        print(row.get("log_tail", ""), flush=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    lines = [f"# toolkit plan calibration ({result.get('device') or 'CPU smoke'}, {result['date']})", "",
             f"Command: `{result['command']}`", "",
             "| config | GPUs | ZeRO | offload | micro x accum | seq | ckpt | LoRA | Liger | predicted peak | measured peak "
             "(max rank) | error | peak reserved | predicted host | measured host | error | tokens/s/GPU pred / meas | "
             "speed error | rc |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gpu_errs, host_errs = [], []
    for r in result["rows"]:
        c, p, m = r["config"], r["predicted"], r.get("measured") or {}
        per = list((m.get("per_rank") or {}).values())
        peak = max((x["peak_allocated_gib"] for x in per if x.get("peak_allocated_gib") is not None), default=None)
        res = max((x["peak_reserved_gib"] for x in per if x.get("peak_reserved_gib") is not None), default=None)
        host = max((x["host_rss_gib"] for x in per if x.get("host_rss_gib") is not None), default=None)
        if r["rc"] == 0:
            if r.get("gpu_error") is not None:
                gpu_errs.append((abs(r["gpu_error"]), c["name"], r["gpu_error"]))
            if r.get("host_error") is not None:
                host_errs.append((abs(r["host_error"]), c["name"], r["host_error"]))
        off = c["offload"] + (f" {c['ratio']:g}" if c["offload"] != "none" and c["ratio"] < 1 else "")
        liger = ("fused" if p["fused_loss"] else "kernels") if p["liger"] else "off"
        lines.append(f"| {c['name']} | {c['gpus']} | {c['stage']}{' (mem)' if c['zero_sizes'] == 'memory' else ''} | "
                     f"{off} | {c['micro']} x {c['accum']} | {c['seq']} | {'yes' if c['ckpt'] else 'no'} | "
                     f"{'yes' if c['lora'] else 'no'} | {liger} | {_f(p['peak_allocated_gib'])} | {_f(peak)} | "
                     f"{_pct(r.get('gpu_error'))} | {_f(res)} | {_f(p['host_rank_gib'])} | {_f(host)} | "
                     f"{_pct(r.get('host_error'))} | {_f(p['tokens_per_s_per_gpu'], 0)} / "
                     f"{_f(m.get('tokens_per_s_per_gpu'), 0)} | "
                     f"{_pct(_err(p['tokens_per_s_per_gpu'], m.get('tokens_per_s_per_gpu')))} | {r['rc']} |")
    lines.append("")
    if gpu_errs:
        w = max(gpu_errs)
        ok = "within" if w[0] <= GPU_TOLERANCE else "ABOVE"
        lines.append(f"- GPU peak: worst error {_pct(w[2])} ({w[1]}), {ok} the {GPU_TOLERANCE:.0%} goal, "
                     f"over {len(gpu_errs)} configurations that ran.")
    if host_errs:
        w = max(host_errs)
        ok = "within" if w[0] <= HOST_TOLERANCE else "ABOVE"
        lines.append(f"- Host RSS: worst error {_pct(w[2])} ({w[1]}), {ok} the {HOST_TOLERANCE:.0%} goal.")
    failed = [r["config"]["name"] for r in result["rows"] if r["rc"] != 0]
    if failed:
        lines.append(f"- Failed (see calibration.json log_tail): {', '.join(failed)}")
    if result.get("skipped_need_more_gpus"):
        lines.append(f"- Skipped, need more GPUs: {', '.join(result['skipped_need_more_gpus'])}")
    if any(r.get("shared_gpu") for r in result["rows"]):
        lines.append("- One-GPU configurations ran side by side on a GPU: allocator peaks are per process, "
                     "tokens/s are not comparable with runs alone.")
    return "\n".join(lines) + "\n"


def cmd_table(a: argparse.Namespace) -> int:
    print(table(json.loads(Path(a.json).read_text())), end="")
    return 0


def cmd_repredict(a: argparse.Namespace) -> int:
    """A calibration.json's measurements against the planner as it is now (no GPU): the table, then each
    row's errors before (the predictions stored at the run) and now."""
    result = json.loads(Path(a.json).read_text())
    by_name = {c.name: c for c in (*CONFIGS, *LONG, *VALIDATE, *LEAVES, *SMOKE)}
    before = {}
    for r in result["rows"]:
        before[r["config"]["name"]] = (r.get("gpu_error"), r.get("host_error"))
        _set_prediction(r, predict(by_name[r["config"]["name"]], a.gpu_mem, bool(result.get("smoke")),
                                    a.host_mem))
    if a.write:  # the stored file with today's predictions
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    lines = [table(result), "| config | GPU error at the run | GPU error now | host error at the run | host error now |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        g, h = before[r["config"]["name"]]
        lines.append(f"| {r['config']['name']} | {_pct(g)} | {_pct(r.get('gpu_error'))} | {_pct(h)} | "
                     f"{_pct(r.get('host_error'))} |")
    print("\n".join(lines))
    return 0


def cmd_bigrun(a: argparse.Namespace) -> int:
    """The plan's choice for a large model on --gpus GPUs of this host, trained through ./launch.sh --plan."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_dir, run_dir = out / "plan", out / "run"
    t0 = time.perf_counter()
    plan_cmd = [sys.executable, "-m", "toolkit", "plan", "--model", a.model, "--gpus", str(a.gpus), "--gpu-mem", f"{a.gpu_mem:g}",
                "--host-mem", f"{a.host_mem:g}", "--seq", str(a.seq), "--global-batch", str(a.global_batch),
                "-o", str(plan_dir), "--force", *(["--micro-batch", str(a.micro_batch)] if a.micro_batch else []),
                *shlex.split(a.plan_args)]
    printed = subprocess.run(plan_cmd, cwd=ROOT, capture_output=True, text=True)
    plan_s = time.perf_counter() - t0
    print(printed.stdout + printed.stderr, flush=True)
    if printed.returncode != 0:
        return printed.returncode
    plan = json.loads((plan_dir / "plan.json").read_text())
    if not a.smoke:  # only the op the chosen config uses: DeepSpeedCPUAdam with offload, else FusedAdam
        op = "cpu_adam" if plan["chosen"]["offload"] != "none" else "fused_adam"
        subprocess.call([sys.executable, "bench/prebuild_ops.py", op], cwd=ROOT)
    env = dict(os.environ) | {"PYTHONUNBUFFERED": "1"}
    # The plan keeps 10% above the predicted peak for the allocator; expandable segments keep
    # fragmentation from eating that margin on a GPU filled to ~90% (recorded in the result).
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    launch = ["bash", "launch.sh", "--plan", str(plan_dir), "--path", "raw", "--master-port", str(a.port), "--",
              f"train.max_steps={a.steps}", f"train.run_dir={run_dir}", "train.export=false", "memory.every=1", "train.log_every=1",
              f"data.num_samples={a.global_batch * (a.steps + 1)}", "train.warmup_steps=2", "train.lr=1e-4",
              "train.overwrite=true", "metrics.tensorboard=false"]
    if a.smoke:
        env["DS_ACCELERATOR"] = "cpu"
    t1 = time.perf_counter()
    with (out / "bigrun.log").open("w") as f:
        rc = call_group(launch, ROOT, env, f, a.timeout)
    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "device": _device_name(), "plan_command": " ".join(plan_cmd[2:]), "plan_s": round(plan_s, 2),
                              "launch": " ".join(launch), "rc": rc,
                              "PYTORCH_CUDA_ALLOC_CONF": env.get("PYTORCH_CUDA_ALLOC_CONF"), "wall_s": round(time.perf_counter() - t1, 1),
                              "chosen": {k: v for k, v in plan["chosen"].items() if k != "ds_config"}}
    try:
        m = measure(run_dir)
        losses = m["losses"]
        result["measured"] = m
        result["loss_first_last"] = [losses[0], losses[-1]] if losses else None
        result["loss_falls"] = bool(losses) and losses[-1] < losses[0]
    except (OSError, ValueError, KeyError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if rc != 0:
        result["log_tail"] = (out / "bigrun.log").read_text()[-4000:]
    (out / "bigrun.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("measured", "log_tail")}, indent=1))
    if "log_tail" in result:
        print(result["log_tail"])
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="the calibration set")
    r.add_argument("--out", required=True)
    r.add_argument("--only", default=None, help="comma-separated configuration names")
    r.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all nvidia-smi lists)")
    r.add_argument("--lanes", type=int, default=3, help="one-GPU configurations running at once")
    r.add_argument("--device", type=int, default=None,
                   help="run every one-GPU configuration on this GPU (a second process takes another)")
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--gpu-mem", type=float, default=139.0)
    r.add_argument("--host-mem", type=float, default=0.0, help="host GiB for the predictions (0: not checked)")
    r.add_argument("--port", type=int, default=29610)
    r.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    r.add_argument("--gpu-limit", type=float, default=0.0,
                   help="memory.gpu_limit_gib of the runs (77: an 80 GB card on a bigger one); 0: the whole GPU")
    r.add_argument("--smoke", action="store_true", help="CPU test of this script: tiny model, DS_ACCELERATOR=cpu")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every configuration's run (repeatable)")
    r.set_defaults(func=cmd_run)
    t = sub.add_parser("table", help="the markdown table of a calibration.json")
    t.add_argument("json")
    t.set_defaults(func=cmd_table)
    rp = sub.add_parser("repredict", help="a calibration.json's measurements against the planner as it is now")
    rp.add_argument("json")
    rp.add_argument("--gpu-mem", type=float, default=139.0)
    rp.add_argument("--host-mem", type=float, default=0.0, help="host GiB for the predictions (0: not checked)")
    rp.add_argument("--write", action="store_true", help="store today's predictions in the file")
    rp.set_defaults(func=cmd_repredict)
    b = sub.add_parser("bigrun", help="a large full fine-tune (--gpus GPUs of this host), as toolkit plan chooses it")
    b.add_argument("--out", required=True)
    b.add_argument("--model", default="llama-3-8b")
    b.add_argument("--seq", type=int, default=2048)
    b.add_argument("--gpus", type=int, default=1, help="GPUs of this host the plan is for and the run takes")
    b.add_argument("--global-batch", type=int, default=16)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--micro-batch", type=int, default=None, help="passed to toolkit plan (default: the plan chooses)")
    b.add_argument("--plan-args", default="", help='more toolkit plan options, e.g. "--precision fp8"')
    b.add_argument("--gpu-mem", type=float, default=139.0)
    b.add_argument("--host-mem", type=float, default=125.0, help="GiB the H200 machine shows (128 GiB installed)")
    b.add_argument("--port", type=int, default=29690)
    b.add_argument("--timeout", type=int, default=540)
    b.add_argument("--smoke", action="store_true", help="CPU test: DS_ACCELERATOR=cpu (use a tiny --model)")
    b.set_defaults(func=cmd_bigrun)
    a = ap.parse_args()
    return int(a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
