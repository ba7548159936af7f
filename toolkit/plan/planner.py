"""What fits, per rank, before launch: GPU peak and host RAM for a stage x offload x micro-batch x
checkpointing choice, and a predicted speed order. Pure arithmetic over a `ModelShape`: no torch,
no deepspeed, no GPU (`toolkit plan` answers in well under a second for a 70B shape).

Why not DeepSpeed's estimators alone: `estimate_zero2/3_model_states_mem_needs` count model states
only, and for a bf16 model they count the optimizer step's transient fp32 gradient as if it lived
through backward. What dominates a real peak is missing there: activations (with or without
checkpointing), the fp32 logits of the loss (or Liger's fused loss), ZeRO-3's gathered layers within
the live/reuse limits, the reduce buckets, and on the host the pinned buffers, which PyTorch's
caching host allocator rounds up to a power of two. Their formulas agree with the phases below where
they overlap (tests/unit/test_planner.py pins that): ZeRO-2's 2P + 18P/N is the optimizer step's
model states here, ZeRO-3's 4x largest layer is its gathered layer with its gradient.

The model: a step has phases, and the per-rank peak is the largest of them:
  A1  backward starts: every activation saved, the loss's logit buffers, model states, gradients held
      across accumulation, ZeRO-3's gathered parameters;
  F   forward ends (fused loss only: Liger computes the head's gradients inside forward);
  A2  the top layer's backward: the reduce buckets exist, the tied head's gradient is held, the MLP's
      backward temporaries (with checkpointing: one layer recomputed);
  B   the optimizer step: activations are gone, the step's fp32 gradient copies exist.
Every byte figure below says where it comes from: DeepSpeed's code (file:function) or a measurement
in bench/results/.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from toolkit.config.ds_config import SPEED_SIZES, ConfigError
from toolkit.plan.liger import (
    LIGER_MODEL_TYPES,
    LOSS_CHUNK_FLOORS,
    loss_chunk_const,
    loss_chunk_rows,
    moe_fused_loss,
)
from toolkit.plan.shapes import FORMULA_TYPES, ModelShape
from toolkit.plan.speedups import (
    activation_offload_on,
    offload_pinned,
    pinned_bytes,
    tiled_loss_on,
    tiled_loss_tile,
)
from toolkit.plan.trace import TRACE_SEQ

GIB = float(1 << 30)
Offload = Literal["none", "optimizer", "all"]
OFFLOADS: tuple[Offload, ...] = ("none", "optimizer", "all")
# offload_optimizer.ratio values tried at stage 3: the fraction of optimizer sub-groups on the CPU.
# Issue 11: on one H200, Llama-2-7B with half of the states on the GPU (0.5) ran 12x faster than all
# on the CPU; the planner looks for such splits itself.
RATIOS = (1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125)

# Activations: every causal LM's decoder layer is traced from its own code (toolkit/plan/trace.py; the shape carries
# the trace); GPT-2 and BERT keep their counted formulas (shapes.FORMULA_TYPES). What cannot be traced is refused with
# one line saying why.

# -- constants from measurements ----------------------------------------------------------------
# Memory the CUDA driver, NCCL and DeepSpeed's kernels hold outside PyTorch's allocator: NVML used
# minus peak reserved per rank, 2x H200 (bench/results/two_gpu.md: 2.37-2.65 GiB; the largest).
CUDA_CONTEXT_GIB = 2.65
# Headroom kept above the predicted peak allocated for the caching allocator (block rounding,
# fragmentation). Runs without memory pressure reserve 20-37% above their peak allocated
# (two_gpu.md), but that is cache the allocator frees and retries before failing; 10% is the
# planner's margin, and bench/plan_calibrate.py records peak reserved next to every prediction.
ALLOC_MARGIN = 0.10
# Host RSS of a toolkit GPU rank with nothing offloaded, once the engine exists (CUDA, torch, DeepSpeed,
# NCCL, transformers, data): bench/results/speed.json toolkit ZeRO-3 rows, 2.01-2.05 GiB; the largest.
HOST_BASELINE_GIB = 2.05
# ... and before the engine exists, when ranks at stages 0-2 hold the model in fp32 on the CPU: the
# ZeRO-2 rows peak at model_loaded, 5.92 GiB for llama-1b and 3.16 for Qwen2-0.5B (speed.json), both
# 1.32 GiB above 4 bytes x parameters.
HOST_EARLY_GIB = 1.32
# The same for DS_ACCELERATOR=cpu ranks (smoke tests): the tiny model on 2 CPU ranks peaks at 0.45-0.58
# GiB RSS per rank on the development machine (raw and Trainer paths, README's closing summary).
HOST_BASELINE_CPU_GIB = 0.5
# Loss without the fused kernel: fp32 log-softmax output + two fp32 logit-sized gradients alive as
# backward starts, 12 bytes per logit (bench/results/anatomy.md: 0.98 + 1.99 GiB at 2048 x 128256).
LOGIT_BYTES = 12
PAIR_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")  # kto: a completion and a mismatched one
REFERENCE_FREE_OBJECTIVES = ("simpo", "orpo", "reward")  # as runtime/objectives/losses.REFERENCE_FREE
# tokens per chunk of a preference run's head (toolkit/runtime/objectives/logprobs.py DEFAULT_CHUNK)
PREF_CHUNK_TOKENS = 2048

# float8 (train.precision=fp8) saves its converted Linears' inputs for backward in float8, and compile then
# keeps fewer bf16 copies around them: llama-1b ZeRO-2, micro 16, one H200 peaked at 50.8 GiB in float8 against
# 59.4 compiled in bf16 (bench/results/fp8_compile.md, run s20), 17.6 kB less per token per layer, 0.54 of the
# bf16 bytes of the converted Linears' inputs (2 x (4 x 2048 + 8192) = 32.8 kB). Qwen2-0.5B measured 4.0 GiB
# less where this gives 2.6; the A/B model (hidden 2048, 8 layers) 0.81 where it gives 0.91.
FP8_INPUT_SAVING = 0.54

# QLoRA's 4-bit weights (bitsandbytes NF4/FP4 with double quantization, its defaults): 4 bits a weight, an 8-bit scale per
# block of 64 and an fp32 scale per 256 blocks. ZeRO-3 partitions the packed weights (stored in the float dtype, a
# parameter) but not the scales (the quant_state on the parameter, not a tensor DeepSpeed sees): every rank keeps those.
BNB4_BYTES = 0.5
BNB4_SCALE_BYTES = 1.0 / 64 + 4.0 / (64 * 256)
# Seconds per call of a 4-bit Linear (bitsandbytes' matmul_4bit: dequantize the weight, then a bf16 matmul), in
# forward, backward and checkpointing's recompute, beyond the bf16 LoRA step. Fitted on one row (llama-1b, LoRA r=8,
# ZeRO-2, micro 4 x 2,048, one H200: 50,416 against 63,172 tokens/s, 224 calls a micro-step;
# bench/results/qlora/): the dequantization's bytes alone would be about 1 ms of the 33 ms, so the cost is taken per
# call, not per weight. Not validated on another shape.
BNB4_CALL_S = 146e-6

# -- speed model constants (the order of candidates; absolute figures are rough) -------------------
GPU_PEAK_FLOPS = 989.4e12  # H100/H200 dense bf16 (toolkit/observe/metrics.py GPU_PEAK_TFLOPS)
# Achieved MFU of everything but attention and Liger's fused loss vs tokens per micro-step t: MFU_MAX * t / (t +
# MFU_HALF_TOKENS), fitted to llama-1b ZeRO-2 with Liger on 2x H200 with attention's time
# (toolkit/plan/attention_rates.py) and the loss's (fused_loss_s at Liger's default chunks, as they ran) taken out:
# micro 4 -> 48.0k, micro 8 -> 59.3k tokens/s/GPU (anchors.md bare loop + Liger), micro 16 -> 64.5k (speed.json):
# 38.2%, 47.7% and 52.3% MFU on the rest, the fit 38.4%, 47.0%, 52.8% (bench/results/speed_model/README.md, "The
# fused loss apart").
MFU_MAX = 0.603
MFU_HALF_TOKENS = 4662.0
# Below llama-1b's hidden size the rest runs slower than that fit: (hidden / 2048) ** this. Fitted to Qwen2.5-1.5B
# (hidden 1536) on one H200, whose short rows ran at 0.81x and 0.84x of the fit (ZeRO-2 micro 4 x 4,096, ZeRO-0 micro
# 8 x 2,048; bench/results/speed_model/README.md). Not above 2,048: no wider shape was measured against it.
NARROW_EXPONENT = 0.65
# Below ZeRO-3 the host's work of a step is each micro-step's decoder layers (kernel launches, autograd, DeepSpeed's
# gradient hooks: HOST_LAYER_S a layer, forward and backward; checkpointing's recompute half as much again) and the
# optimizer step's (HOST_STEP_S); a step takes at least that. Fitted to Qwen2-0.5B (24 layers) at ZeRO-2 on one H200,
# whose steps took 0.192, 0.197 and 0.201 s at micro 1, 2 and 4 x 4,096 (GPU work predicted 0.06-0.18 s) and 0.160 s
# a micro-step at micro 4 with four (bench/results/speed_model/narrow/). ZeRO-3 counts its own host time (leaves,
# hooks), which these runs include. Full fine-tunes only: under LoRA, llama-1b's 16 layers at ZeRO-2 took 0.130 s a
# step in all (micro 4 x 2,048, bench/results/qlora/), under the 0.139 s these constants would say.
HOST_LAYER_S = 6.5e-3
HOST_STEP_S = 0.035
# Liger's fused loss, timed apart from the rest (bench/fused_loss.py on one H200, 180 rows of six heads, 2,048-65,536
# tokens, chunk_mem_const 1-32; bench/results/speed_model/fused_loss_h200.json): each chunk of r rows costs the
# hypotenuse of its matmuls at LOSS_FLOPS (6 r H V, a trained head) and its walk over the head's weight and gradient
# at LOSS_BYTES_PER_S (8 V H bytes), plus LOSS_LOGIT_BYTES a logit. Fitted to all rows: 4.9% rms, within 12% of every
# row of at least 4 ms; the four under it (Phi-3's head at 2,048 tokens) 19-22% low. A frozen head (LoRA): its two
# matmuls and the weight read twice, not measured.
LOSS_FLOPS = 670e12
LOSS_BYTES_PER_S = 3.0e12
LOSS_LOGIT_BYTES = 5.4


def loss_const(w: Workload, tokens: int) -> int:
    """The chunk_mem_const a run of this workload gives Liger's fused loss over `tokens` rows (runtime/speed/kernels)."""
    s = w.shape
    return loss_chunk_const(w.loss_chunks, tokens=tokens, hidden=s.hidden_size, vocab=s.vocab_size,
                            floor=LOSS_CHUNK_FLOORS.get(s.model_type, 1))


def fused_loss_s(tokens: int, hidden: int, vocab: int, const: int, *, trained: bool = True) -> float:
    """Seconds of Liger's fused linear cross-entropy, forward and backward, over `tokens` rows at chunk_mem_const."""
    rows = loss_chunk_rows(tokens, hidden, vocab, const)
    matmuls = (6.0 if trained else 4.0) * rows * hidden * vocab / LOSS_FLOPS
    walk = (8.0 if trained else 4.0) * vocab * hidden / LOSS_BYTES_PER_S
    return -(-tokens // rows) * math.hypot(matmuls, walk) + LOSS_LOGIT_BYTES * tokens * vocab / LOSS_BYTES_PER_S


# Liger's kernels with the fused loss: bare loop llama-1b ZeRO-2 micro 4, 48.0k with vs 40.1k without
# (anchors.md).
LIGER_SPEEDUP = 1.20
# ZeRO-3 cost per micro-step per billion parameters (gathers, hooks), from llama-1b on 2x H200 with the
# fused loss at micro 16: 0.517 s/step at ZeRO-3 against 0.502 at ZeRO-2 (bench/results/zero3_tuning.md),
# 15 ms for 1.24B. The same constants give 0.71 s for ZeRO-3 without the fused loss at micro 8 x 2
# (measured 0.714).
ZERO3_S_PER_GPARAM = 0.012
# ZeRO-3 with a DeepSpeed hook on every submodule (layers that are not leaf modules: LoRA, train.zero3_leaves=false,
# model types without eager leaves): the host spends about this long on each call of a module with parameters
# (fetch, release), and the step waits on it where it outlasts the GPU's work. Fitted to llama-1b at micro 2 on one
# H200 (0.412 s a micro-step with hooks, 0.224 s as leaves; 2 passes x 16 layers x 9 modules); the same constant gives
# Qwen2.5-1.5B at micro 4 0.72 s (measured 0.754) and the Qwen2.5-3B shape at 64K with tiled MLPs 15.4 s (14.7):
# bench/results/speed_model/README.md. Checkpointing's recompute is not counted again (llama-1b micro 8: 0.50 s
# measured, 0.41 s from 2 passes).
ZERO3_HOOK_S = 1.43e-3
# The same for decoder layers as leaf modules: each layer's call (forward, checkpointing's recompute, backward) fetches
# and releases the whole layer. On one H200 7.0 ms a call, fitted to llama-1b at micro 2, 32 calls a micro-step (0.224
# s a micro-step, the GPU's work 0.11 s; Qwen2-0.5B and Gemma-3-1B took 6.1-7.0 ms there too, whatever their layers);
# at micro 8 with checkpointing the 48 calls take 0.34 s, under the GPU's 0.39 (measured 0.369). On 4 H100s llama-1b's
# micro 2 took 0.261 s a micro-step (8.2 ms a call), which also gives micro 8 with checkpointing on 4 within 3%
# (bench/results/speed_model/README.md). 3 ranks and more than 4 were not measured.
# Beyond one rank a call's time grows with the modules that hold the layer's parameters (layer_modules: llama-1b's and
# Qwen2-0.5B's 9, Qwen3's 11 with its q/k norms, Gemma 3's 13 with six norms). On 2 H200s, the medians of three runs by
# turns in one lease (bench/results/speed_model/families/leaf_calls/README.md): at micro 1, where the step waits on
# the host alone, llama-1b 5.7, Qwen2-0.5B 5.9, Qwen3-4B 6.6 and Gemma-3-1B 7.9 ms a call, 0.60-0.66 ms a module (by
# parameter tensors Qwen2's biases read 0.49 ms, the others 0.60-0.64); llama-1b's micro 2 x 2,048 took 0.74 ms a
# module, where host and GPU overlap less. 6.0 ms for 9 modules keeps the largest error of those six rows least (11.8%).
# Single runs in other leases read 0.53 (llama-1b, 2026-11-28) to 0.78 ms a module (Qwen2-0.5B, 2026-11-29): a lease's
# host moves these rows by about a fifth.
ZERO3_LEAF_S = {1: 7.0e-3, 2: 6.0e-3, 4: 8.2e-3}  # by world size: the largest measured size at or below it
ZERO3_LEAF_MODULES = 9  # llama-1b's, for which ZERO3_LEAF_S holds


def _leaf_s(world: int, modules: int) -> float:
    """Host seconds of one call of a leaf layer whose parameters `modules` modules hold (ZERO3_LEAF_S: llama-1b's 9)."""
    per_call = ZERO3_LEAF_S[max(n for n in ZERO3_LEAF_S if n <= world)]
    return per_call if world == 1 else per_call * modules / ZERO3_LEAF_MODULES


# train.zero_sizes=memory (h^2 buckets, ~2-layer live limit) against the speed sizes: llama-1b ZeRO-3
# lost 35% of its tokens/s, GPT-2 ZeRO-2 a quarter (ds_config.py SPEED_SIZES comment).
MEMORY_SIZES_SPEED = {3: 0.65, 2: 0.75, 1: 0.75, 0: 1.0}
# Compiled decoder layers at ZeRO-3 under LoRA (not leaf modules): DeepSpeed's hooks split each layer into a graph
# per module; llama-1b on one H200 ran 48.0k compiled against 65.2k eager in bf16 (run s23, before leaf modules).
# As leaves they run as at ZeRO-2: 67.8k compiled, 80.3k float8, against 67.7k and 80.6k at ZeRO-2 (run s26).
ZERO3_COMPILED_SPEED = 0.74
# float8 matmuls against bf16 ones, the gain on the converted Linears' share of the FLOPs (f): step time goes
# from 1 to (1 - f) + f / G. G fitted where measured (bench/results/fp8_compile.md, fp8 against compiled bf16 at
# ZeRO-2): llama-1b (hidden 2048, f 0.69) 79.9k / 67.7k -> G 1.29; Qwen2-0.5B (hidden 896, f 0.54) 106.7k / 102.6k
# -> G 1.08; Llama-2-7B (hidden 4096, ZeRO-3, gradient checkpointing, f 0.89) 13,261 / 9,790 -> G 1.42 (two device
# calls of one day on the same code, bench/results/bigrun.md). Between points G follows log2(hidden), flat outside.
FP8_GAIN = ((896, 1.077), (2048, 1.287), (4096, 1.417))
# DeepSpeedCPUAdam parameters per second on the H200 host (16 cores): issue 11's Llama-2-7B runs,
# all states on the CPU at micro 1 (270 tokens/s) and half at micro 8 (3,180), leave 0.98e9 and
# 1.13e9 parameters/s once the GPU's share of the step is taken out.
CPU_ADAM_PARAMS_PER_S = 1.0e9
# Muon's Newton-Schulz FLOPs (muon_step_s) per second of step time it adds, one H200, llama-1b, seq 2048, 16
# sequences a step (bench/results/optimizers/speed_llama1b): 4.58e13 FLOPs a step added 0.084 s at ZeRO-2 (0.561 ->
# 0.645 s) and 0.15 s at ZeRO-3 (gathering each matrix's partitions and its momentum first).
MUON_NS_FLOPS_PER_S = {2: 5.4e14, 3: 3.0e14}
# Host<->GPU copies for offload: not measured here; PCIe Gen5 x16 moves about 25 GB/s one way in practice.
PCIE_BYTES_PER_S = 25e9
# A Mixture-of-Experts block's backward (grouped_mm experts, transformers 5.x) holds, per routed token, the gate/up/
# activation gradients (3 x the expert intermediate) and about this many hidden-sized bf16 tensors (the permuted
# gradients, the gradient of the permuted input). Fitted to one measured peak, the reduced-layer Qwen3-30B-A3B shape
# at micro 8 x seq 4096 on one H100, ZeRO-2 (58.5 GiB, run s39; the intermediate term alone predicted 53.9); with it
# 58.9 there and the ZeRO-3 rows 57.9 against 55.9 (one H100, s39) and 42.3 against 42.0 (two H200s, s41):
# bench/results/moe.md. Refitted to 3 (from 5) when the layer's saved bytes became the trace's (toolkit/plan/trace.py):
# the trace counts Qwen3's q/k norms, 22 kB a token a layer that the earlier formula missed and this term had absorbed;
# every row then as close as before (tests/unit/test_moe_model.py). Not checked on a model of another shape (Mixtral's
# experts are wider than its hidden size).
MOE_BWD_HIDDENS = 3
# Offloaded checkpointed inputs (model.activation_offload): the layer inputs left on the GPU at once, the newest (kept
# for the first backward) and the one before (its copy out in flight; no forward stash, toolkit/runtime/sequence/
# offload.py). Pinned buffers: the copies out overlap compute, each copy back is waited for (PCIE_BYTES_PER_S; not
# measured). Pageable host buffers: each copy waits, at about this rate each way. Measured on one H200 (16 cores,
# 128 GiB host), the Llama-3-8B shape with 8 layers at 393,216 tokens: 118.0 s a step against 101.0 without offload
# for 7 inputs of 3 GiB out and back (2.65e9 bytes/s); its peak 51.3 GiB against 66.3 (bench/results/long_seq/).
OFFLOAD_INPUTS_ON_GPU = 2
PAGEABLE_BYTES_PER_S = 2.65e9


# -- inputs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lora:
    r: int = 8
    targets: tuple[str, ...] = ("q_proj", "v_proj")


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int
    nodes: int = 1
    gpu_mem_gib: float = 80.0
    host_mem_gib: float | None = None
    """Host RAM per node; None: not checked."""
    cpu_ranks: bool = False
    """DS_ACCELERATOR=cpu ranks (smoke tests): the host baseline of a CPU rank."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


# Packed rows through the varlen kernel cost about what causal rows of this many tokens cost, however short the
# documents: one llama-1b layer, fwd + bwd, H100 (bench/results/real_data.md), ~120-token documents 3.10 ms at
# 16 x 2048 (causal sdpa 3.29: T ~ 1,930), 3.14 ms at 4 x 8192 (causal 9.57: T ~ 2,690), 3.35 ms at 1 x 32768
# (causal 35.86: T ~ 3,060). Measured end to end (real_data.md, run s32): llama-1b seq 2048 on the 100k corpus
# ran at 67.8k tokens/s; the plan with --doc-len predicts 67.1k, the same as full-length rows.
VARLEN_FLOOR_TOKENS = 2_600.0


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    seq_len: int
    global_batch: int
    lora: Lora | None = None
    liger: bool = True
    """Liger kernels wanted (model.liger); applied where toolkit/plan/liger.py would apply them."""
    attn: str = "sdpa"
    fused_loss: str = "auto"
    """model.liger_fused_loss: auto or true (on; at ZeRO-3 with the head as an external parameter), false."""
    compile: str = "off"
    """train.compile: off, torch, or auto (toolkit/plan/speedups.py compile_on, resolved per stage for a run long
    enough to pay it back). Compiled, Liger keeps its fused loss only and inductor fuses the rest."""
    fp8: str | None = None
    """train.precision=fp8: the float8 recipe (tensorwise, rowwise); None: bf16 matmuls."""
    doc_len: float | None = None
    """Packed rows (data.packing): the documents' token-weighted mean length (sum of L^2 / sum of L, what a run
    prints). Attention then runs within each document (variable-length attention), so its FLOPs per token
    follow this length instead of seq_len; memory is sdpa's (no mask is built). None: full-length rows."""
    sequence_parallel: int = 1
    """train.sequence_parallel: each row's tokens spread over this many ranks (Ulysses). Activations per rank are
    a row's 1/N; model states are sharded over every rank as before; the global batch counts groups of N ranks.
    The all-to-alls around each attention are not counted in the step time."""
    tiled_mlp: bool = False
    """model.tiled_mlp resolved: each MLP keeps only its input and runs one tile of micro x hidden tokens at a time,
    once more in backward."""
    activation_offload: str = "auto"
    """model.activation_offload (auto, true, pinned, pageable, false), resolved per choice as the run does
    (toolkit/plan/speedups.py): with checkpointing, the layer inputs it keeps wait in host buffers, not on the GPU."""
    tiled_loss: str = "auto"
    """model.tiled_loss (auto, true, false), resolved per choice as the run does (toolkit/plan/speedups.py): without
    Liger's fused loss, the logits exist one tile of tokens at a time."""
    expert_parallel: int = 1
    """DeepSpeed AutoEP's autoep_size (the run's `expert_parallel` section; ZeRO-3 only here): each rank holds
    num_experts / N whole experts instead of a ZeRO-3 shard of every expert, the same bytes when N is the rank count,
    and gathers none of them, so the MoE block's gathered parameters and its whole-block gradient before the
    reduce-scatter leave the peak. Speed as ZeRO-3's (measured 0.96-0.98x of it on 2 and 4 H200s, moe.md)."""
    zero3_leaves: str = "auto"
    """train.zero3_leaves (auto, true, false): at ZeRO-3, decoder layers as leaf modules (toolkit/plan/speedups.py
    leaves_on), or a DeepSpeed hook on each submodule (ZERO3_HOOK_S)."""
    objective: str = "sft"
    """train.objective: sft, or a preference objective (dpo, ipo, simpo, orpo, kto). A preference micro-batch holds
    micro_batch pairs (kto: rows, each a completion and a mismatched one), two sequences of seq_len each; its log-probs come from the head in chunks of tokens
    (objectives/logprobs.py), no logits tensor whole and no Liger fused loss."""
    reference: str = "none"
    """A preference run's reference (pref.reference resolved): adapter (one more forward, nothing held), engine (a
    ZeRO-3 copy: 2 bytes a parameter / world on every rank, and its forward), precomputed or none (neither)."""
    generations: int = 8
    """objective grpo: completions a prompt (rl.num_generations). A GRPO micro-batch holds micro_batch prompts x this
    many sequences of seq_len (prompt + completion) tokens, packed; global_batch counts prompts."""
    completion_len: int = 0
    """objective grpo: rl.max_completion_length (seq_len - completion_len is the prompt's length)."""
    optimizer: str = "adamw"
    """The DeepSpeed config's optimizer (toolkit/config/optimizers.py): adamw, or muon (one momentum buffer for the
    2-D hidden matrices, Adam's two for the rest; Newton-Schulz on each matrix every step)."""
    states: str = "fp32"
    """Master weights and optimizer states: fp32, or bf16 (bf16_master_weights_and_grads + bf16_optimizer_states)."""
    load_in_4bit: bool = False
    """model.load_in_4bit (QLoRA, toolkit/runtime/quant): the decoder layers' Linears frozen in 4-bit (BNB4_BYTES a
    weight), the head and the rest in bf16; LoRA only."""
    loss_chunks: str = "auto"
    """model.liger_chunk_mem_const (auto or an integer): the rows of each chunk of Liger's fused loss
    (toolkit/plan/liger.py loss_chunk_const), its transient logits and its time (fused_loss_s)."""
    quantized_build: bool = False
    """With load_in_4bit, a preset or a directory whose checkpoint names are the model's: quantized while it is built
    or read (runtime/quant build_4bit), so the host holds the float weights that stay (embeddings, head, norms) and one
    Linear, never the whole float model (another directory's is)."""

    @property
    def sequences(self) -> int:
        """Sequences a micro-batch item holds: a pair's two, a GRPO prompt's completions, else one."""
        return 2 if self.objective in PAIR_OBJECTIVES else self.generations if self.objective == "grpo" else 1

    @property
    def attended(self) -> float:
        """The 12·L·H·T term's T: seq_len for full-length rows; for packed rows the documents' length, but not
        below VARLEN_FLOOR_TOKENS (the varlen kernel over short documents costs what causal attention over that
        many tokens costs) and not above seq_len."""
        if not self.doc_len or run_attention(self.shape, self.attn) == "eager":  # eager masks packed rows: the full row
            return float(self.seq_len)
        return min(float(self.seq_len), max(self.doc_len, VARLEN_FLOOR_TOKENS))


@dataclass(frozen=True)
class ZeroSizes:
    """The ZeRO sizes that matter for memory, in elements (DeepSpeed's config names)."""

    reduce_bucket: int
    prefetch_bucket: int
    persistence_threshold: int
    max_live: int
    max_reuse: int
    sub_group: int = 1_000_000_000

    @classmethod
    def named(cls, rule: str, hidden: int) -> ZeroSizes:
        """train.zero_sizes: the same numbers toolkit/config/ds_config.py resolves "auto" to."""
        if rule == "speed":
            s = {k.rsplit(".", 1)[1]: v for k, v in SPEED_SIZES.items()}
            return cls(s["reduce_bucket_size"], s["stage3_prefetch_bucket_size"],
                       s["stage3_param_persistence_threshold"], s["stage3_max_live_parameters"],
                       s["stage3_max_reuse_distance"])
        if rule == "memory":
            h = hidden
            return cls(h * h, int(0.9 * h * h), 10 * h, 24 * h * h, 24 * h * h)
        raise ConfigError(f"zero sizes must be speed or memory, got {rule!r}")


@dataclass(frozen=True)
class Choice:
    stage: int
    offload: Offload = "none"
    """none; optimizer (states to CPU); all (optimizer and parameters to CPU, stage 3)."""
    ratio: float = 1.0
    """offload_optimizer.ratio: fraction of the optimizer's sub-groups on the CPU (stage 3; else 1)."""
    micro_batch: int = 1
    grad_accum: int = 1
    grad_ckpt: bool = False
    zero_sizes: str = "speed"


@dataclass
class Prediction:
    choice: Choice
    liger: bool
    """Liger kernels applied (RMSNorm, SwiGLU, RoPE)."""
    fused_loss: bool
    """Liger's fused linear cross-entropy (toolkit/plan/liger.py: on unless model.liger_fused_loss=false)."""
    compiled: bool
    """The decoder layers compiled (train.compile resolved for this stage)."""
    phase: str
    gpu: dict[str, float]
    """GiB per rank at the peak, by category."""
    persistent: dict[str, float]
    """GiB per rank held between steps: params, grads, optimizer (what a run's breakdown measures)."""
    peak_allocated_gib: float
    gpu_need_gib: float
    host: dict[str, float]
    host_rank_gib: float
    """Host RSS per rank at its largest phase boundary (model loaded, engine ready, steps): what the
    memory snapshots of a run measure."""
    host_build_rank_gib: float
    """Host RSS per rank while build_model runs: stages 0-2 build the whole model in fp32 on the CPU,
    also under adapter autocast, which casts the frozen base to bf16 only once it exists. Snapshots do
    not see it when it is above host_rank_gib; host_node_gib and fits_host count it."""
    host_node_gib: float
    """Host RAM the node needs: its ranks at the larger of host_rank_gib and host_build_rank_gib."""
    fits_gpu: bool
    fits_host: bool
    step_time_s: float
    tokens_per_s_per_gpu: float
    activation_offload: str = ""
    """Where checkpointed layer inputs wait: "" on the GPU, "pinned" or "pageable" host buffers."""

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits"] = self.fits
        return d


# -- shape arithmetic ---------------------------------------------------------------------------------


def trainable_params(shape: ModelShape, lora: Lora | None) -> int:
    """Full fine-tune: every parameter the model builds trainable (BLT builds its patcher frozen: frozen_params).
    LoRA: r x (in + out) per targeted linear per layer (PEFT)."""
    if lora is None:
        return shape.total_params - shape.frozen_params
    per_layer = sum(lora.r * (i + o) for name, i, o in shape.linears if name.rsplit(".", 1)[-1] in lora.targets)
    return per_layer * shape.num_layers


def check_lora_targets(shape: ModelShape, lora: Lora) -> None:
    names = {n.rsplit(".", 1)[-1] for n, _, _ in shape.linears}
    missing = [t for t in lora.targets if t not in names]
    if missing:
        raise ConfigError(f"LoRA targets {missing} are not linear layers of this model; it has {sorted(names)}")


def _sub_groups(shape: ModelShape, world: int, sub_group: int) -> list[int]:
    """ZeRO-3's optimizer sub-groups (stage3.py _create_fp16_sub_groups): per-rank partitions of the
    parameters, in order, closed once a group reaches sub_group_size elements."""
    groups, cur = [], 0
    numels = [math.ceil(n / world) for n in shape.param_numels()]
    if sum(numels) <= sub_group:
        return [sum(numels)] if numels else []
    for i, n in enumerate(numels):
        cur += n
        if cur >= sub_group or i == len(numels) - 1:
            groups.append(cur)
            cur = 0
    return groups


def _cpu_groups(n_groups: int, ratio: float) -> int:
    """stage3.py _create_fp32_partitions: sub-group i goes to the CPU when i >= int((1 - ratio) * n)."""
    return n_groups - min(n_groups, int((1 - ratio) * n_groups))


# -- activations ------------------------------------------------------------------------------------


def layer_activation_bytes(shape: ModelShape, *, seq_len: int, attn: str, liger: bool,
                           lora: Lora | None, autocast: bool = False, compiled: bool = False,
                           tiled_mlp: bool = False) -> float:
    """Bytes one decoder layer saves for backward, per token (bf16 activations).

    GPT-2 and BERT: `_layernorm_layer_bytes`. Every other causal LM: its trace (toolkit/plan/trace.py), the storages
    its own code keeps on fake tensors, with the kernels the run swaps in substituted there (flash attention, Liger's
    RMSNorm and gated MLP). The trace of llama-1b gives 108,680 bytes a token; the live tensors at the peak of a real
    run measured 108.7 kB (bench/results/anatomy.md: 3.35 GiB for 16 layers x 2048 tokens). On top of the trace:
      LoRA: the base is traced frozen; a targeted linear keeps its input, once per distinct input tensor (q, k and v
        share theirs) unless something else keeps it already, and lora_A's output (r values), which lora_B saves;
      autocast (LoRA in adapter autocast mode: fp32 adapters, bf16 activations): PEFT's lora.Linear casts its input
        to the adapter's dtype (`x = self._cast_input_dtype(x, lora_A.weight.dtype)`, fp32) and autocast casts that
        back to bf16 for lora_A's matmul, a new tensor per adapter, which lora_A saves: 2 x in_features per targeted
        linear, and the shared input is kept by no one. Counted with saved_tensors_hooks on a Qwen2-0.5B layer under
        CPU autocast (peft 0.21): two (tokens, 896) bf16 tensors, one with the cast disabled;
      eager attention: the trace at two lengths gives its per-token bytes as a + b x seq_len (the S x S softmax);
      tiled MLP (DeepSpeed's TiledMLP): the MLP keeps its input only; the rest exists for one tile at a time.
    compiled: inductor fuses what Liger's kernels fuse, and keeps about what they keep (the caller passes liger).
    """
    if shape.trace is None:
        if shape.model_type in FORMULA_TYPES:
            return _layernorm_layer_bytes(shape, seq_len=seq_len, attn=attn, compiled=compiled)
        raise ConfigError(no_activation_model(shape))
    t, h = shape.trace, shape.hidden_size
    variant = f"{'liger' if liger else 'plain'}-{'full' if lora is None else 'frozen'}"
    total = t["layer"][variant]  # every call of the layer with gradients (HRM's cycles): what follows is a call's
    calls = layer_calls(shape)[1]
    if tiled_mlp:
        total += 2 * h * calls - t["parts"][variant].get("mlp", 0.0)
    if t.get("attention") == "eager":  # no fused path: traced eager at TRACE_SEQ tokens
        total += t["eager"][1] * (seq_len - TRACE_SEQ)
    elif attn == "eager":
        total += t["eager"][0] + t["eager"][1] * seq_len
    if lora is not None:
        targets = [x for x in t["linears"] if x[0].rsplit(".", 1)[-1] in lora.targets
                   and not (tiled_mlp and x[0].startswith("mlp."))]
        if autocast:
            total += calls * sum(2 * fin for _, fin, _, _ in targets)
        else:
            total += calls * sum(2 * fin for fin, kept in {g: (fin, kept) for _, fin, g, kept in targets}.values()
                                 if not kept)
        total += calls * 2 * lora.r * len(targets)
    return float(total)


def no_activation_model(shape: ModelShape) -> str:
    why = shape.trace_error or ("toolkit plan models causal LMs and BERT" if shape.task == "causal_lm"
                                else f"it is not a causal LM (task {shape.task})")
    return f"toolkit plan has no activation model for model type {shape.model_type!r}: {why}"


def attention_backward_bytes(shape: ModelShape, *, lora: Lora | None, autocast: bool) -> float:
    """Bytes per token a checkpointed Llama-like layer holds while its attention runs backward (sdpa/flash), besides
    the layers' checkpointed inputs. Counted from the live tensors at that moment on an H100 (bench/results/long_seq/
    anatomy.md: llama-3.2-1b, LoRA on q/v and full fine-tune, 16K-171K tokens, torch 2.11):
      kept by the recomputed layer: the q/k/v projections' input (2h: full fine-tune; under LoRA in autocast a copy
        per adapter, as layer_activation_bytes counts), q, k, v, the output, the fp32 log-sum-exp, lora_A's outputs;
      gradients: the residual stream's (2h), the attention output's (2q, o_proj's backward), dq, dk, dv, and the
        kernel's fp32 workspace, 8q + 4 x heads (16,512 bytes a token for 32 heads of 64).
    """
    h = shape.hidden_size
    q, kv, heads = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.num_heads
    qkv = ("q_proj", "k_proj", "v_proj")
    if lora is None:
        inputs = 2 * h
    elif autocast:
        inputs = 2 * h * sum(n in lora.targets for n in qkv) + (2 * q if "o_proj" in lora.targets else 0)
    else:
        inputs = 2 * h if any(n in lora.targets for n in qkv) else 0
    adapters = 2 * lora.r * sum(n in lora.targets for n in (*qkv, "o_proj")) if lora is not None else 0
    kept = inputs + 2 * q + 4 * kv + 2 * q + 4 * heads + adapters
    grads = 2 * h + 2 * q + 2 * q + 4 * kv + 8 * q + 4 * heads
    return float(kept + grads)


def _layernorm_layer_bytes(shape: ModelShape, *, seq_len: int, attn: str, compiled: bool) -> float:
    """Bytes a GPT-2 block or a BERT layer saves for backward, per token (bf16, full fine-tune, dropout 0.1 as
    the presets have it), counted from what autograd keeps in transformers' modules:
      LayerNorm: its input (2h; its fp32 mean and rstd are 8 bytes), twice a layer;
      projections (GPT-2's Conv1D, BERT's Linear): their input, once per distinct input: GPT-2's fused qkv
        projection, attention output, MLP in and MLP out (4 of them, the MLP out's at the intermediate width);
        BERT's q, k and v share theirs (3 in all besides);
      attention (sdpa): q, k, v and the output (8h), fp32 log-sum-exp; its dropout runs inside the kernel;
        eager: the fp32 softmax and its bf16 copy (6 bytes per score) plus the dropout mask (1 byte);
      GPT-2's tanh-GELU ("gelu_new") is eager Python arithmetic: its input, the tanh, 0.5x and 1 + tanh (4 x 2i)
        and the product the output projection keeps (2i); compiled, one fused kernel keeps only its input (2i);
        BERT's exact GELU keeps its input (2i);
      dropout on the attention output and the MLP output: a 1-byte mask each (h).
    GPT-2: 20h + 10i (compiled 20h + 4i); BERT: 20h + 4i. Checked against measured peaks in
    tests/unit/test_planner.py (GPT-2-124M eager and compiled, bench/results/speed.json run s21; BERT-large at
    ZeRO-0, 2 and 3, toolkit-bert.json and toolkit-zero-2gpu.json).
    """
    h, i, heads = shape.hidden_size, shape.intermediate_size, shape.num_heads
    norms = 2 * (2 * h + 8)
    proj_inputs = 3 * 2 * h + 2 * i
    attention = 8 * h + 4 * heads
    if attn == "eager":
        attention += 7 * heads * seq_len
    gelu = 8 * i if (shape.model_type == "gpt2" and not compiled) else 2 * i
    dropout = 2 * h
    # the output projection's input is the GELU output (2i), counted in proj_inputs; 20h in all besides the MLP
    return float(norms + proj_inputs + attention + gelu + dropout)


def _final_norm_bytes(shape: ModelShape, *, liger: bool, full: bool, head_saves_input: bool) -> float:
    h = shape.hidden_size
    if shape.trace is not None:  # the final norm's saved tensors, traced; the head's input where the head trains
        return float(shape.trace["final"][f"{'liger' if liger else 'plain'}-{'full' if full else 'frozen'}"]
                     + (2 * h if head_saves_input else 0))
    # GPT-2: ln_f keeps its input, the embedding dropout its mask; BERT: the embeddings' LayerNorm and dropout
    # (its classifier reads one token)
    return float(2 * h + 8 + h + (2 * h if head_saves_input else 0))


def fp8_saved_bytes(shape: ModelShape, recipe: str) -> float:
    """Bytes per token per layer float8 saves against bf16 (FP8_INPUT_SAVING x the converted Linears' inputs)."""
    from toolkit.plan.speedups import fp8_converts

    return FP8_INPUT_SAVING * 2.0 * sum(i for _, i, o in shape.linears if fp8_converts(recipe, i, o))


def fp8_flop_share(shape: ModelShape, recipe: str, flops_per_token: float, grad_ckpt: bool = False) -> float:
    """The share of a step's FLOPs in the Linears float8 converts (6 x in x out per token per layer; 8 with
    gradient checkpointing, whose recomputed forward runs them again; at each call where layers run more than once:
    2 a forward call, 4 a call with gradients)."""
    from toolkit.plan.speedups import fp8_converts

    conv = sum(i * o for _, i, o in shape.linears if fp8_converts(recipe, i, o))
    fwd, grad = layer_calls(shape)
    per = 2.0 * fwd + 4.0 * grad + (2.0 * grad if grad_ckpt and not reversible(shape) else 0.0)
    return min(1.0, per * conv * shape.num_layers / flops_per_token)


def fp8_gain(hidden: int) -> float:
    """G of FP8_GAIN at this hidden size: log-linear between the measured points, flat outside them."""
    if hidden <= FP8_GAIN[0][0]:
        return FP8_GAIN[0][1]
    for (h0, g0), (h1, g1) in itertools.pairwise(FP8_GAIN):
        if hidden <= h1:
            return g0 + (g1 - g0) * (math.log2(hidden) - math.log2(h0)) / (math.log2(h1) - math.log2(h0))
    return FP8_GAIN[-1][1]


# -- the prediction ------------------------------------------------------------------------------------


def compiled(w: Workload, stage: int) -> bool:
    """Whether this choice's decoder layers are compiled (train.compile, auto resolved for a CUDA run)."""
    from toolkit.plan.speedups import compile_on, leaves_blocked

    if w.objective != "sft":  # preference and RL runs stay eager (toolkit/runtime/resolved.py: the reference must match)
        return False
    no_leaves = "with train.zero3_leaves=false" if w.zero3_leaves == "false" else leaves_blocked(lora=w.lora is not None)
    return compile_on(str(w.compile), cuda=True, steps=None, fp8=bool(w.fp8), stage=stage, no_leaves=no_leaves)[0]


def leaves(w: Workload, stage: int) -> bool:
    """Whether this choice's decoder layers are ZeRO-3 leaf modules (toolkit/plan/speedups.py leaves_on, as the run
    resolves train.zero3_leaves; the plan models no NVMe offload)."""
    from toolkit.plan.speedups import leaves_blocked, leaves_on

    try:
        return leaves_on(w.zero3_leaves, stage=stage, compiled=compiled(w, stage),
                         blocked=leaves_blocked(lora=w.lora is not None), model_type=w.shape.model_type,
                         objective=w.objective)[0]
    except ValueError:  # true where leaves are blocked: the run refuses it; the plan counts hooks
        return False


def tiles_mlp(w: Workload) -> bool:
    """model.tiled_mlp applies: a traced decoder's dense MLP (MoE blocks are not tiled: sequence/tiling.py)."""
    return w.tiled_mlp and w.shape.trace is not None and not w.shape.num_experts


def split_by_hooks(w: Workload, stage: int) -> bool:
    """Compiled layers that ZeRO-3's hooks on every submodule split into a graph per module: at ZeRO-3 where the
    layers are not leaf modules."""
    return stage == 3 and compiled(w, stage) and not leaves(w, stage)


def _liger(w: Workload, stage: int) -> tuple[bool, bool]:
    """(layers fused, fused loss): Liger's layer kernels or compiled layers, and Liger's fused loss, as
    toolkit/plan/liger.choose decides them on a CUDA machine with Liger."""
    from toolkit.plan.liger import choose

    c = choose(w.liger, cuda=True, model_type=w.shape.model_type, task=w.shape.task, stage=stage,
               supported=LIGER_MODEL_TYPES, fused_loss=w.fused_loss, compiled=compiled(w, stage),
               objective=w.objective)
    # compiled, inductor fuses RMSNorm, SwiGLU and RoPE where Liger's kernels would (the same peak within 1.4%:
    # llama-1b micro 16, 59.4 GiB compiled against 58.6 with Liger, run s20): the activations Liger's keep
    layers = bool(c.kwargs.get("rms_norm")) or (compiled(w, stage) and w.shape.trace is not None)
    return layers, bool(c.kwargs.get("fused_linear_cross_entropy"))


def _gathered_bytes(shape: ModelShape, n: int, sizes: ZeroSizes, offload_param: bool,
                    every_layer: bool = False) -> float:
    """ZeRO-3 parameters gathered whole on a rank as backward starts (partitioned_param_coordinator.py).

    every_layer: decoder layers as leaf modules with checkpointing. There DeepSpeed kept every layer gathered at the
    peak, not the reuse-distance few below: llama-1b on 2 H200s, micro 8 with checkpointing, had all 16 layers' weights
    alive (bench/peak_anatomy.py, bench/results/speed_model/anatomy-leaves-ckpt-2gpu.json: 48 MLP-, 32 q/o- and 32
    k/v-sized blocks besides the head), 1.3 GiB above the rule, as on 4 H100s; Qwen2.5-1.5B at 262K with parameters on
    the CPU 1.8 GiB above it. DeepSpeed 0.19.8's __params_to_release walks the trace with the released module's leaf
    flag, so for a leaf it recurses into the model itself and releases nothing in forward (2 CPU ranks; releasing them
    instead cost 9-44% of the speed for 0.44 GiB: bench/results/speed_model/README.md, session 58). GPU runs without
    checkpointing peaked within 2.6% of the rule below (not traced), so it stays there.

    The head was used last in forward and is first in backward, so it stays gathered. A layer's
    parameters are released after its forward unless they reappear within stage3_max_reuse_distance
    elements of the trace; forward's last layers come back first in backward, so the last j layers
    stay while 2 * j * layer + 2 * head < max_reuse, within stage3_max_live_parameters. With one rank
    and parameters on the GPU there is nothing to gather (seeds_tables.md: ZeRO-3 = ZeRO-2 on 1 GPU).
    Backward then prefetches up to stage3_prefetch_bucket_size elements ahead.
    """
    if n == 1 and not offload_param:
        return 0.0
    head = shape.embed_numel
    layer = shape.layer_numel
    if every_layer:
        return 2.0 * (head + shape.num_layers * layer)
    kept = 0
    for j in range(shape.num_layers):
        if 2 * j * layer + 2 * head >= sizes.max_reuse or head + (j + 1) * layer > sizes.max_live:
            break
        kept += 1
    prefetch = min(sizes.prefetch_bucket, layer) if kept < shape.num_layers else 0
    return 2.0 * (head + kept * layer + prefetch)


def predict(w: Workload, c: Choice, hw: Hardware) -> Prediction:
    """Per-rank GPU peak (allocated), GPU need and host RSS for one choice."""
    s = w.shape
    if s.trace is None and s.model_type not in FORMULA_TYPES:
        raise ConfigError(no_activation_model(s))
    if s.trace is None and w.lora is not None:
        raise ConfigError(f"toolkit plan models LoRA on causal LM decoder layers, not {s.model_type!r}")
    if w.load_in_4bit and (w.lora is None or w.fp8 or w.objective == "grpo"):
        raise ConfigError("a 4-bit base (--load-in-4bit) trains LoRA adapters (--lora) in bf16; GRPO and float8 "
                          "are not planned with it")
    if w.objective != "sft" and (s.task != "causal_lm" or w.sequence_parallel > 1 or w.fp8 or s.num_experts):
        raise ConfigError("toolkit plan models preference and RL objectives on dense causal LMs in bf16 without "
                          "sequence parallelism (as the runs support them)")
    if w.objective == "grpo" and not 0 < w.completion_len < w.seq_len:
        raise ConfigError(f"a GRPO plan's sequence ({w.seq_len}) is its prompt plus its completion "
                          f"({w.completion_len}): both at least one token")
    if w.fp8 and s.num_experts:
        raise ConfigError("toolkit plan models float8 (train.precision=fp8) on dense models: it converts nn.Linear, "
                          "and a Mixture-of-Experts model's experts are not")
    if w.fp8 and s.trace is None:
        raise ConfigError(f"float8 (train.precision=fp8) converts nn.Linear in causal LMs; {s.model_type!r} has "
                          "none to convert (GPT-2: Conv1D) or is not a causal LM (BERT)")
    if s.num_experts and w.fused_loss == "auto":  # the run's rule (toolkit/plan/liger.py moe_fused_loss)
        plain = predict(replace(w, fused_loss="false"), c, hw)
        tokens = c.micro_batch * w.seq_len // w.sequence_parallel
        if moe_fused_loss("auto", moe=True, tokens=tokens, logits_fit=plain.fits_gpu)[0] == "false":
            return plain
    n = hw.world
    if c.stage == 3 and c.grad_ckpt and w.zero3_leaves == "auto" and not w.lora:
        from toolkit.plan.speedups import leaves_gathered_gib, too_gathered

        held = leaves_gathered_gib(s.total_params, stage=3, grad_ckpt=True, world=n, offload_param=c.offload == "all")
        if too_gathered(held, hw.gpu_mem_gib):  # as the run resolves auto (speedups.leaves_on)
            w = replace(w, zero3_leaves="false")
    stage, lora = c.stage, w.lora
    ep = w.expert_parallel
    if ep > 1:
        _check_expert_parallel(s, ep, n, stage)
    offload_opt = c.offload in ("optimizer", "all") and stage >= 1
    offload_param = c.offload == "all" and stage == 3
    ratio = c.ratio if (offload_opt and stage == 3) else (1.0 if offload_opt else 0.0)
    sizes = ZeroSizes.named(c.zero_sizes, s.hidden_size)
    fused, flce = _liger(w, stage)
    pref = w.objective != "sft"
    flce = flce and not pref  # pairs take their log-probs from the head in chunks (objectives/logprobs.py)
    comp = compiled(w, stage)
    liger = flce or (fused and not comp)  # Liger's own kernels (the table's "liger" column)
    p_all = s.total_params
    t_all = trainable_params(s, lora)
    frozen = p_all - t_all
    full = lora is None
    # LoRA below ZeRO-3 under bf16 trains like PEFT: fp32 adapters, bf16 frozen base, torch autocast
    # (toolkit/config/ds_config.py adapter_autocast); at ZeRO-3 DeepSpeed's bf16 mode keeps everything bf16.
    autocast = lora is not None and stage < 3
    tokens = c.micro_batch * w.seq_len * w.sequences // w.sequence_parallel  # this rank's slice of each row
    h, vocab = s.hidden_size, s.vocab_size
    tiled_loss = not pref and tiled_loss_on(w.tiled_loss, fused_loss=flce, tokens=w.seq_len // w.sequence_parallel,
                                            causal_lm=s.task == "causal_lm", moe=bool(s.num_experts))[0]
    largest = max(s.param_numels())

    # ---- what each rank holds between steps ------------------------------------------------------
    # bytes of master copy and moments a trained parameter keeps (toolkit/config/optimizers.py bytes_per_param)
    low = w.states == "bf16"
    # bf16 masters on the GPU are the bf16 weights themselves (ZeRO-3: DeepSpeed; ZeRO-1/2: runtime/low_precision.py);
    # offloaded, or beside fp32 adapters under autocast, they are a copy
    state_bytes = optimizer_bytes(w, s, stage, shared_master=low and not offload_opt and not autocast)
    if stage < 3:
        params = 2.0 * frozen + (4.0 if autocast else 2.0) * t_all
        # ZeRO-0 in bf16 is DeepSpeed's FP16_Optimizer (fp32 master + Adam m, v for every parameter);
        # fp32 adapters under autocast need no master copy at ZeRO-0 (no wrapper), ZeRO-1/2 keep one.
        opt_per = state_bytes - 4.0 if (autocast and stage == 0) else state_bytes
        optimizer = opt_per * t_all / (1 if stage == 0 else n) if not offload_opt else 0.0
        grads = 0.0
        buffers = 2.0 * largest if offload_opt else 0.0  # stage_1_and_2.py temp_grad_buffer_for_gpu_offload
        groups: list[int] = []
        gpu_groups: list[int] = []
    else:
        small = sum(x for x in s.param_numels() if x <= sizes.persistence_threshold)
        # partitions (lp_param_buffer) + persistent small parameters kept whole on every rank
        params = (0.0 if offload_param else 2.0 * p_all / n) + 2.0 * small
        # LoRA adapters are parameters the shape does not list; their partitions make one sub-group
        groups = _sub_groups(s, n, sizes.sub_group) if lora is None else [math.ceil(t_all / n)]
        n_cpu = _cpu_groups(len(groups), ratio) if offload_opt else 0
        gpu_groups = groups[:len(groups) - n_cpu]
        gpu_numel = sum(gpu_groups)
        # GPU sub-groups keep fp32 master + Adam m, v (FusedAdam, or torch AdamW for the GPU share of a
        # partial offload) and, under offload, their fp32 gradient buffer (initialize_optimizer_states).
        optimizer = state_bytes * gpu_numel
        grads = 2.0 * t_all / n if not offload_opt else (2.0 if low else 4.0) * gpu_numel
        buffers = 2.0 * sizes.reduce_bucket  # stage3.py: one ipg bucket, allocated at init
    quantized = quantized_numel(s) if w.load_in_4bit else 0
    if quantized:  # the base's Linears in 4 bits (with their scales) where the float model held 2 bytes each
        share = 1 if stage < 3 else n
        params -= 2.0 * quantized / share - (BNB4_BYTES * quantized / share + BNB4_SCALE_BYTES * quantized)
    if w.reference == "engine":  # the frozen ZeRO-3 copy's partitions and its small parameters kept whole
        small = sum(x for x in s.param_numels() if x <= sizes.persistence_threshold)
        params += 2.0 * p_all / n + 2.0 * small
    persistent = params + optimizer + grads + buffers

    # gradients held across micro-steps of an accumulation window (stages 0-2)
    held = 0.0
    if c.grad_accum > 1 and stage < 3 and not offload_opt:
        held = (4.0 if autocast else 2.0) * t_all / (1 if stage == 0 else n)

    # ---- activations ---------------------------------------------------------------------------------
    tiled = tiles_mlp(w)
    attn = run_attention(s, w.attn)
    per_layer = layer_activation_bytes(s, seq_len=w.seq_len, attn=attn, liger=fused, lora=lora, autocast=autocast,
                                       compiled=comp, tiled_mlp=tiled)
    if split_by_hooks(w, stage) and s.trace is not None:
        # Under LoRA the layers are not ZeRO-3 leaves, DeepSpeed's hooks split a compiled layer into a graph per
        # module, and less fuses: llama-1b micro 16 peaked at 66.5 GiB compiled against 57.6 eager with Liger (run
        # s23, no leaves), between Liger's per-layer bytes and eager transformers' (the mean gives 67.0). As leaves
        # the layers peak as at ZeRO-2 (58.5 against 59.4 GiB, float8 49.9 against 50.8; run s26).
        eager = layer_activation_bytes(s, seq_len=w.seq_len, attn=attn, liger=False, lora=lora, autocast=autocast)
        per_layer = (per_layer + eager) / 2
    elif w.fp8:  # at each call with gradients; a reversible layer keeps nothing of its own in forward to save on
        per_layer = max(0.0, per_layer - fp8_saved_bytes(s, w.fp8) * layer_calls(s)[1])
    head_saves_input = full and not flce and s.task == "causal_lm"
    final = _final_norm_bytes(s, liger=fused, full=full, head_saves_input=head_saves_input) * tokens
    offloaded = _activation_offload(w, c, hw, tokens)
    # reversible layers (Reformer) keep nothing of a layer in forward: backward runs each again from its outputs, one
    # at a time, whatever checkpointing says
    rev = recompute_bytes(s, liger=fused, lora=lora)
    if c.grad_ckpt and not reversible(s):
        # non-reentrant checkpointing keeps each layer's input; backward recomputes one layer at a time. Offloaded
        # (toolkit/runtime/sequence/offload.py), the newest input stays and the one before may still be copying out;
        # in backward each comes back for its own layer only.
        # a layer run more than once with gradients (HRM's cycles) keeps an input a call and recomputes one call
        grad_calls = layer_calls(s)[1]
        kept = min(s.num_layers, OFFLOAD_INPUTS_ON_GPU) if offloaded else math.ceil(s.num_layers * grad_calls)
        saved = kept * checkpoint_input_bytes(s) * tokens + final
        recompute = per_layer / grad_calls * tokens
    else:
        saved = s.num_layers * per_layer * tokens + final
        recompute = rev * tokens
    # backward of the top layer's MLP: the gradient of the down projection's input, and in plain
    # transformers the two gradients the SiLU-mul product splits into (Liger computes them in place)
    mlp_bwd = (1 if fused else 3) * 2.0 * s.intermediate_size * tokens + 2 * 2.0 * h * tokens
    if s.num_experts:  # per routed token: the gate/up/activation gradients and hidden-sized ones (MOE_BWD_HIDDENS)
        mlp_bwd = 2.0 * s.experts_per_token * tokens * (3 * s.expert_intermediate + MOE_BWD_HIDDENS * h) \
            + 2 * 2.0 * h * tokens
    if reversible(s):
        # a reversible layer's largest part runs backward beside what its recompute keeps, and its gradients are of
        # that part's tensors, not the MLP's: as much again at most (Reformer-16K at 8 x 16,384 on an H200: its LSH
        # attention's backward held 5.0 GiB of gradients beside the 7.4 GiB its recompute kept, where the MLP's term
        # counts 3.5; families/reversible_anatomy.json)
        mlp_bwd = max(mlp_bwd, recompute)
    if tiled:  # one tile of micro x hidden tokens at a time, recomputed with its activations, then its gradients
        tile = min(tokens, c.micro_batch * h)
        mlp_bwd = ((2 if fused else 3) + 1 + (1 if fused else 3)) * 2.0 * s.intermediate_size * tile \
            + 2 * 2.0 * h * tokens
    if flce:
        # liger fused_linear_cross_entropy: grad_input and (trained head) grad_weight are computed in
        # forward and kept; one chunk of chunk_size x V bf16 logits at a time, its gradient written in place (measured:
        # 2 bytes a logit beside them, bench/results/speed_model/fused_loss_h200.json "transient_gib"), and 4 bytes a
        # trained head weight more that the validation rows' peaks at forward end hold (fitted there, not traced)
        chunk = loss_chunk_rows(tokens, h, vocab, loss_const(w, tokens))
        kept_head = 2.0 * vocab * h if full else 0.0  # the trained head's gradient outlives the input's
        kept_loss = 2.0 * h * tokens + kept_head
        loss_fwd = kept_loss + 2.0 * chunk * vocab + (4.0 * vocab * h if full else 0.0)
        loss_bwd = kept_loss
    elif pref:
        # objectives/logprobs.py: the head's input kept; in backward one chunk of CHUNK x V logits in bf16, its
        # fp32 copy, the softmax and its gradient (fp32), and a trained head's fp32 gradient with its bf16 copy
        chunk = min(tokens, PREF_CHUNK_TOKENS)
        kept_head = 6.0 * vocab * h if full else 0.0
        kept_loss = 0.0
        loss_fwd = 0.0
        loss_bwd = 14.0 * chunk * vocab + kept_head
    else:
        kept_loss = kept_head = 0.0
        loss_fwd = 0.0
        # a classifier (BERT) has a logit per class: nothing vocabulary-sized; tiled: one tile's, recomputed
        logit_tokens = min(tokens, tiled_loss_tile(vocab)) if tiled_loss else tokens
        loss_bwd = float(LOGIT_BYTES) * vocab * logit_tokens if s.task == "causal_lm" else 0.0
    # the tied (or any trained) head's gradient waits for the embedding's at the end of backward
    head_grad = 2.0 * vocab * h if (full and s.tied_embeddings and not flce and s.task == "causal_lm") else 0.0
    # stage_1_and_2.py setup_buckets: two reduce_bucket_size buffers (overlap_comm double buffer) of
    # _gradient_reduction_buffer_dtype(), which is self.dtype, the dtype of the optimizer's first
    # parameter: bf16 in DeepSpeed's bf16 mode, fp32 for the fp32 adapters under autocast (whatever
    # the adapters' size: the buffers are allocated whole). q-z2-lora-s2048-m4 (calibration.md) measured
    # 9.29 GiB besides parameters and states at its peak where 2-byte buckets predicted 7.31.
    buckets = 2 * (4.0 if autocast else 2.0) * sizes.reduce_bucket if stage in (1, 2) else 0.0
    # AutoEP's experts stay on their ranks: nothing of them is gathered (only the rest of each layer)
    local = s.without_experts() if ep > 1 else s
    gathered = _gathered_bytes(local, n, sizes, offload_param,
                               every_layer=leaves(w, stage) and c.grad_ckpt) if stage == 3 else 0.0
    if quantized:  # gathered layers hold the packed weights: a quarter of their bf16 bytes
        gathered *= 1 - (1 - BNB4_BYTES / 2) * quantized / p_all
    if stage == 3 and n > 1 and s.num_experts and lora is None and ep == 1:
        # a Mixture-of-Experts block is one ZeRO-3 leaf: its whole bf16 gradient exists before its reduce-scatter
        # (3 x hidden x expert intermediate per expert; Qwen3-30B-A3B: 1.13 GiB a layer)
        gathered += 2.0 * s.num_experts * 3 * h * s.expert_intermediate

    # ---- optimizer step transients (activations gone) -------------------------------------------------
    if stage == 0:
        step = (4.0 if autocast else 10.0) * t_all  # FP16_Optimizer.step: grads + fp32 copies + flat
    elif stage < 3:
        # grads partition + flat + fp32 (18P/N with states); bf16 masters take the bf16 partition as it is
        step = 0.0 if offload_opt else (4.0 if low else 8.0) * t_all / n
    else:
        big = max(gpu_groups) if gpu_groups else 0
        # flat + fp32 grad / torch AdamW's sqrt temp; bf16 masters: the flat bf16 gradient only
        step = ((2.0 if low else 6.0) * big) if not offload_opt else 4.0 * big

    # the top layer's backward: its recomputed activations with its MLP's gradients (all layers' saved
    # activations without checkpointing), the loss's kept tensors, the reduce buckets
    top_act, top_loss, top_buckets = saved + recompute + mlp_bwd, kept_loss, buckets
    # QLoRA: a Linear's weight dequantized to bf16 for its matmul, in forward and again for backward's input gradient
    dequant = 2.0 * 2.0 * max(i * o for _, i, o in s.linears) if quantized else 0.0
    if c.grad_ckpt and s.trace is not None and not s.num_experts and not reversible(s):
        top_act, top_loss, top_buckets = _checkpointed_top(
            s, lora, attn, tokens=tokens, kept=kept, offloaded=bool(offloaded), autocast=autocast, fused=fused,
            mlp=recompute + mlp_bwd, kept_head=kept_head, buckets=buckets)
    phases = {
        "backward start": persistent + held + saved + loss_bwd + gathered,
        **({"rollout": persistent + _rollout_bytes(w, c, stage, p_all)} if w.objective == "grpo" else {}),
        "top layer backward": persistent + held + top_act + top_loss + top_buckets + head_grad + gathered + dequant,
        "optimizer step": persistent + step,  # step includes the gradients it consumes
    }
    if flce:
        phases["forward end"] = persistent + held + saved + loss_fwd + gathered
    phase = max(phases, key=phases.__getitem__)
    peak = phases[phase]
    categories = {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers,
                  "held grads": held if phase not in ("optimizer step", "rollout") else 0.0}
    if phase == "optimizer step":
        categories["step"] = step
    elif phase == "rollout":
        categories["rollout"] = phases["rollout"] - persistent
    else:
        categories["activations"] = top_act if phase == "top layer backward" else saved
        categories["loss"] = loss_bwd if phase == "backward start" else loss_fwd if phase == "forward end" else top_loss
        categories["gathered"] = gathered
        if phase == "top layer backward":
            categories["buckets"] = top_buckets
            categories["head grad"] = head_grad
    gpu = {k: v / GIB for k, v in categories.items() if v}
    peak_gib = peak / GIB
    need = peak_gib * (1 + ALLOC_MARGIN) + CUDA_CONTEXT_GIB

    # ---- host ------------------------------------------------------------------------------------------
    inputs_host = {}
    if offloaded:  # from the first step on, a host buffer per layer input but the newest (DeepSpeed's keep_last)
        one = checkpoint_input_bytes(s) * tokens
        inputs_host[f"checkpointed layer inputs ({offloaded})"] = (s.num_layers - 1) * (
            pinned_bytes(one) if offloaded == "pinned" else one)
    host, build_bytes = _host_bytes(s, c, hw, stage=stage, t_all=t_all, autocast=autocast,
                                    offload_opt=offload_opt, offload_param=offload_param, groups=groups,
                                    n_gpu_groups=len(gpu_groups), sizes=sizes, steps=inputs_host,
                                    state_bytes=state_bytes)
    if quantized and w.quantized_build:  # the float weights that stay, and the Linear being quantized
        floats = 4.0 * (p_all - quantized)
        build_bytes = HOST_EARLY_GIB * GIB + floats + 4.0 * max(i * o for _, i, o in s.linears)
        if "model build (fp32)" in host:  # stages 0-2: what the host keeps until DeepSpeed moves it
            host["model build (fp32)"] = floats
    elif quantized and stage == 3:  # built outside zero.Init: each rank holds the fp32 model before quantizing it
        build_bytes = max(build_bytes, HOST_EARLY_GIB * GIB + 4.0 * p_all)
    host_rank = sum(host.values()) / GIB
    host_build = build_bytes / GIB
    host_node = max(host_rank, host_build) * hw.gpus_per_node
    fits_gpu = need <= hw.gpu_mem_gib
    fits_host = hw.host_mem_gib is None or host_node <= hw.host_mem_gib
    step_s = _step_time_s(w, c, hw, p_all=p_all, t_all=t_all, fused_loss=flce, tiled_loss=tiled_loss,
                          offload_opt=offload_opt,
                          offload_param=offload_param, cpu_params=sum(groups) - sum(gpu_groups) if stage == 3
                          else (t_all / n if offload_opt else 0.0))
    if offloaded:  # pageable: each copy out and back waits; pinned: copies out overlap, each copy back is waited for
        moved = c.grad_accum * (s.num_layers - 1) * checkpoint_input_bytes(s) * tokens
        step_s += 2 * moved / PAGEABLE_BYTES_PER_S if offloaded == "pageable" else moved / PCIE_BYTES_PER_S
    tps = c.micro_batch * c.grad_accum * w.seq_len * w.sequences / w.sequence_parallel / step_s
    return Prediction(
        choice=c, liger=liger, fused_loss=flce, compiled=comp, phase=phase, gpu=gpu,
        persistent={"params": params / GIB, "grads": grads / GIB, "optimizer": optimizer / GIB},
        peak_allocated_gib=peak_gib, gpu_need_gib=need, host={k: v / GIB for k, v in host.items()},
        host_rank_gib=host_rank, host_build_rank_gib=host_build, host_node_gib=host_node, fits_gpu=fits_gpu, fits_host=fits_host,
        step_time_s=step_s, tokens_per_s_per_gpu=tps, activation_offload=offloaded)


def _rollout_bytes(w: Workload, c: Choice, stage: int, p_all: int) -> float:
    """A GRPO rollout beside the model states (toolkit/runtime/rl/step.py, generation/batched.py): under ZeRO-3 the
    whole bf16 model gathered (gather.whole_model; the rank's shard stays), and one generate call's batch (the
    window's prompts x generations, at most gather.MAX_BATCH sequences): each sequence's KV cache at full length (a
    static cache: the prompt's width rounded up to STATIC_WIDTH), its prefill's working set and next-token logits
    (plan/generation.bytes_per_sequence)."""
    from toolkit.plan.generation import MAX_BATCH, STATIC_WIDTH, DecodeShape, bytes_per_sequence

    s = w.shape
    decode = DecodeShape(layers=s.num_layers, hidden=s.hidden_size, intermediate=s.intermediate_size,
                         heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.mean_head_dim, vocab=s.vocab_size)
    prompt = -(-(w.seq_len - w.completion_len) // STATIC_WIDTH) * STATIC_WIDTH
    batch = min(c.micro_batch * c.grad_accum * w.generations, MAX_BATCH)
    gathered = 2.0 * p_all if stage == 3 else 0.0
    return gathered + batch * bytes_per_sequence(decode, prompt, w.completion_len, 2, True)


def _checkpointed_top(s: ModelShape, lora: Lora | None, attn: str, *, tokens: int, kept: int, offloaded: bool,
                      autocast: bool, fused: bool, mlp: float, kept_head: float,
                      buckets: float) -> tuple[float, float, float]:
    """(activations, loss, buckets) at the peak of a checkpointed Llama-like model's backward: the top layer's MLP
    or attention backward, or the layer below's once ZeRO-1/2's buckets exist. From the live tensors on an H100
    (bench/results/long_seq/anatomy.md):
      - the final norm's input and the fused loss's input gradient are gone once the top layer's backward runs;
        a trained head's gradient, computed in the fused loss's forward, stays;
      - Liger's first RMSNorm keeps the layer's input itself, which the checkpoint already keeps;
      - ZeRO-1/2 allocate their reduce buckets at the first gradient to reduce: in the top layer's MLP backward
        (full fine-tune, adapters on the MLP) or o_proj's, else after its attention backward (LoRA on q/k/v): the
        layer below, one input fewer, then holds them.
    """
    h = s.hidden_size
    # the checkpointed inputs, and the step's int64 ids, labels and positions and RoPE's bf16 cos and sin
    inputs = (kept * checkpoint_input_bytes(s) + 3 * 8 + 2 * 2 * s.head_dim) * tokens
    mlp_live = mlp - (2.0 * h * tokens if fused else 0.0)
    # eager attention's score-sized backward tensors are not modelled here (nor were they before): its MLP phase only
    attn_live = attention_backward_bytes(s, lora=lora, autocast=autocast) * tokens if attn != "eager" else 0.0
    layer = max(mlp_live, attn_live)
    # adapters whose gradient comes before the top layer's attention kernel runs backward: the MLP's and o_proj's
    before_attention = ("gate_proj", "up_proj", "down_proj", "o_proj")
    early = lora is None or any(t in lora.targets for t in before_attention)
    if early or not buckets or s.num_layers < 2:
        return inputs + layer, kept_head, buckets
    below = inputs - (0.0 if offloaded else 2.0 * h * tokens) + layer
    if below + buckets >= inputs + layer:
        return below, kept_head, buckets
    return inputs + layer, kept_head, 0.0


def _activation_offload(w: Workload, c: Choice, hw: Hardware, tokens: int) -> str:
    """"" (inputs on the GPU), "pinned" or "pageable": model.activation_offload resolved as the run resolves it."""
    s = w.shape
    on = activation_offload_on(w.activation_offload, grad_ckpt=c.grad_ckpt, cuda=not hw.cpu_ranks,
                               layers=s.num_layers, hidden=s.hidden_size, tokens=tokens, gpu_bytes=hw.gpu_mem_gib * GIB)[0]
    if not on:
        return ""
    pinned = offload_pinned(layers=s.num_layers, layer_bytes=2.0 * s.hidden_size * tokens,
                            ranks_per_node=hw.gpus_per_node, setting=w.activation_offload,
                            host_bytes=hw.host_mem_gib * GIB if hw.host_mem_gib is not None else None)[0]
    return "pinned" if pinned else "pageable"


def _host_bytes(s: ModelShape, c: Choice, hw: Hardware, *, stage: int, t_all: int, autocast: bool,
                offload_opt: bool, offload_param: bool, groups: list[int], n_gpu_groups: int,
                sizes: ZeroSizes, steps: dict[str, float] | None = None,
                state_bytes: float = 12.0) -> tuple[dict[str, float], float]:
    """Host RSS of one rank by category at its largest phase boundary, and the RSS while the model is
    built (bytes). steps: host memory that exists from the first step on (offloaded layer inputs)."""
    steps = steps or {}
    n = hw.world
    late = (HOST_BASELINE_CPU_GIB if hw.cpu_ranks else HOST_BASELINE_GIB) * GIB
    early = (HOST_BASELINE_CPU_GIB if hw.cpu_ranks else HOST_EARLY_GIB) * GIB
    if stage < 3:
        # every rank builds the model in fp32 on the CPU (toolkit/runtime/model.py) before DeepSpeed moves it;
        # that memory returns to the system before offloaded states are allocated: the larger counts
        build = 4.0 * s.total_params
        # Adapter autocast: build_model(frozen_bf16=True) casts every frozen parameter to bf16 before it
        # returns, so from model_loaded on the rank holds 2 bytes per frozen parameter and 4 per adapter
        # parameter; the fp32 storage is returned to the system (q-z2-lora-s2048-m4 in calibration.md:
        # 2.31 GiB at model_loaded, its largest snapshot, against 1.32 + 0.92 = 2.24 here; the fp32
        # count gave 3.16). The fp32 model existed inside build_model all the same: the build's RSS.
        # Checked on the CPU with toolkit.runtime.model.build_model for Qwen2-0.5B + LoRA: VmRSS 0.39 -> 1.32
        # GiB across the build with frozen_bf16, 2.24 without; VmHWM 2.74 GiB for both.
        loaded = 2.0 * (s.total_params - t_all) + 4.0 * t_all if autocast else build
        states = 0.0
        if offload_opt:
            part = t_all / n
            w_ = 4 if state_bytes == 12.0 else 2  # bf16 masters: master and gradient in bf16, CPU Adam moments too
            states = (pinned_bytes(w_ * part) + pinned_bytes(2 * part) + pinned_bytes(w_ * part)  # stage_1_and_2.py: pinned fp32
                      + (state_bytes - w_) * part + pinned_bytes(2 * max(s.param_numels())))  # master, bf16 temp, fp32 grad;
            if c.grad_accum > 1:                                            # Adam m, v; grad staging
                states += _accumulated_grads_in_cpu(s, n)
        model = {"process": early, "model (bf16 base, fp32 adapters)" if autocast else "model build (fp32)": loaded}
        if early + loaded > late + states + sum(steps.values()):
            return model, early + build
        return ({"process": late} | ({"offloaded states": states} if states else {}) | steps), early + build
    # ZeRO-3 builds inside zero.Init, on the GPU. The toolkit's random init copies one module's
    # parameters to the CPU in fp32 at a time (toolkit/runtime/model.py _init_zero3_on_cpu), freed before the
    # engine exists: not in the measured RSS of any snapshot (speed.json ZeRO-3 rows), left out.
    out: dict[str, float] = {"process": late}
    if offload_opt:
        cpu = groups[n_gpu_groups:]
        out["grad partitions (bf16, pinned)"] = pinned_bytes(2.0 * t_all / n)  # grad_partitions_flat_buffer
        low = state_bytes != 12.0
        out["optimizer (master, moments)" if low else "optimizer (fp32 master, m, v)"] = state_bytes * sum(cpu)
        out["bf16 grads (pinned)" if low else "fp32 grads (pinned)"] = sum(pinned_bytes((2.0 if low else 4.0) * g)
                                                                           for g in cpu)
    if offload_param:
        # zero.Init pins each parameter's partition, then _create_fp16_partitions_with_defragmentation
        # copies them into one pinned flat buffer; the freed blocks stay in the pinned cache
        out["params (bf16, pinned)"] = pinned_bytes(2.0 * s.total_params / n) + sum(
            pinned_bytes(2.0 * math.ceil(x / n)) for x in s.param_numels())
    return out | steps, 0.0


def quantized_numel(s: ModelShape) -> int:
    """Weights model.load_in_4bit quantizes: every nn.Linear of the decoder layers (the head stays bf16; fused experts
    are not nn.Linear)."""
    return s.num_layers * sum(i * o for _, i, o in s.linears)


def optimizer_bytes(w: Workload, s: ModelShape, stage: int = 2, shared_master: bool = False) -> float:
    """Bytes of optimizer state per trained parameter, averaged over the trained parameters: AdamW's master + m + v,
    Muon's master + momentum on the 2-D hidden matrices (DeepSpeed's use_muon: not embeddings or the head) and
    Adam's on the rest (toolkit/config/optimizers.py bytes_per_param; shared_master: bf16 masters that are the
    weights)."""
    from toolkit.config.optimizers import bytes_per_param

    adam = bytes_per_param("adamw", w.states, matrix=False, shared_master=shared_master)  # type: ignore[arg-type]
    if w.optimizer != "muon":
        return adam
    muon = bytes_per_param("muon", w.states, matrix=True, stage=stage,  # type: ignore[arg-type]
                           shared_master=shared_master)
    if w.lora is not None:  # the adapters' A and B are all matrices
        return muon
    return (muon * matrix_numel(s) + adam * (s.total_params - matrix_numel(s))) / s.total_params


def muon_step_s(s: ModelShape, stage: int, world: int) -> float:
    """Muon's Newton-Schulz on every hidden matrix, each step: 5 iterations of 4 m^2 n + 2 m^3 FLOPs for an m x n
    matrix (m <= n), the matrices shared among the ranks at ZeRO 1-3 (each orthogonalizes its partition's), all on
    every rank at ZeRO-0, at the rate measured per stage (MUON_NS_FLOPS_PER_S)."""
    flops = 0.0
    for _, fan_in, fan_out in s.linears:
        m, n = sorted((fan_in, fan_out))
        flops += 5 * (4.0 * m * m * n + 2.0 * m ** 3)
    share = 1 if stage == 0 else world
    return s.num_layers * flops / share / MUON_NS_FLOPS_PER_S[3 if stage == 3 else 2]


def matrix_numel(s: ModelShape) -> int:
    """Parameters of the decoder layers' 2-D weights (norms are 1-D, biases too): what Muon steps."""
    return sum(n for layer in s.layers() for name, n in layer if name.endswith("weight") and "norm" not in name)


def _accumulated_grads_in_cpu(s: ModelShape, n: int) -> float:
    """stage_1_and_2.py buffer_to_accumulate_to_in_cpu: a pinned bf16 buffer of the whole parameter for
    every parameter with elements in this rank's partition (rank 0: the first 1/N of the flat order)."""
    budget = s.total_params / n
    total, seen = 0.0, 0
    for x in s.param_numels():
        if seen >= budget:
            break
        total += pinned_bytes(2.0 * x)
        seen += x
    return total


def _step_time_s(w: Workload, c: Choice, hw: Hardware, *, p_all: int, t_all: int, fused_loss: bool,
                 tiled_loss: bool = False,
                 offload_opt: bool, offload_param: bool, cpu_params: float) -> float:
    """Seconds per optimizer step on one rank: per micro-step, attention at its measured kernel rate
    (toolkit/plan/attention_rates.py) plus the rest at an MFU that grows with the tokens per micro-step, ZeRO-3's cost
    (leaves: per parameter; hooks on every submodule: host time the GPU waits on), offload copies; then the CPU Adam
    step."""
    from toolkit.plan import attention_rates

    s = w.shape
    pref = w.objective != "sft"
    # per rank; its heads' attention spans the whole row; a preference micro-batch: chosen and rejected; a GRPO
    # one: each prompt's completions (the rollout's generation is not in this model: time/generate_s shows it)
    tokens = c.micro_batch * w.seq_len * w.sequences // w.sequence_parallel
    # a token runs through its routed experts only: FLOPs by active parameters (Mixture-of-Experts)
    p_run, t_run = s.active_params, min(t_all, s.active_params)
    layer_p = p_run - sum(n for _, n in (*s.prefix_params, *s.suffix_params))
    if s.token_params:  # parts run at other counts than one a token (BLT): the trained matmuls a token runs through
        p_run, layer_p = s.token_params, s.token_layer_params
        t_run = min(t_all, p_run)
    flops = 4.0 * p_run + 2.0 * t_run  # toolkit/observe/metrics.py flops_per_token, attention apart
    # parameters built frozen (BLT's patcher, which picks the patches in every forward): a forward only
    flops += 2.0 * s.frozen_params
    # layers run more than once a forward (HRM's cycles: 4 calls a layer, 2.5 of them with gradients): the layers'
    # forward FLOPs at every call, their backward's at the calls with gradients
    fwd_calls, grad_calls = layer_calls(s)
    flops += 2.0 * layer_p * (fwd_calls - 1) + (2.0 * layer_p + 2.0 * t_run * layer_p / p_run) * (grad_calls - 1)
    forwards = 0.0  # attention forwards beyond the step's own forward and backward, in layer calls
    # one more forward of the decoder layers (checkpointed), not of the embedding or the head; a reversible model's
    # recompute is its second call (layer_calls), whatever checkpointing says
    ckpt = c.grad_ckpt and not reversible(s)
    calls = s.num_layers * (fwd_calls + grad_calls * (1 + ckpt))  # a micro-step's layer calls, the recompute's too
    if ckpt:
        flops += 2.0 * layer_p * grad_calls
        forwards += grad_calls
    if tiled_loss:  # each tile's logits computed again in backward
        flops += 2.0 * s.hidden_size * s.vocab_size
    if tiles_mlp(w):  # each MLP forward once more
        flops += 6.0 * s.hidden_size * s.intermediate_size * s.num_layers * grad_calls
    if pref:  # the chunked head's logits once more in backward; the reference's forward where it runs one
        flops += 2.0 * s.hidden_size * s.vocab_size
        if w.reference in ("adapter", "engine"):  # the reference's forward: no reversible recompute
            forward_calls = fwd_calls - reversible(s)
            flops += 2.0 * (p_run + layer_p * (forward_calls - 1))
            forwards += forward_calls
    mfu = MFU_MAX * tokens / (tokens + MFU_HALF_TOKENS)  # fitted on runs with Liger's kernels and fused loss
    comp = compiled(w, c.stage)
    if not (fused_loss or comp):  # compiled layers fuse what Liger's kernels fuse (1.02x llama-1b, run s20)
        mfu /= LIGER_SPEEDUP
    mfu *= min(1.0, s.hidden_size / 2048) ** NARROW_EXPONENT
    # Liger's fused loss at its own measured time (fused_loss_s): its head's FLOPs leave the rest's
    head = fused_loss and not pref and s.task == "causal_lm"
    if head:
        flops -= (6.0 if w.lora is None else 4.0) * s.vocab_size * s.hidden_size
    dense = flops * tokens / (mfu * GPU_PEAK_FLOPS)
    if w.fp8:  # never under LoRA (refused)
        f = fp8_flop_share(s, w.fp8, flops, c.grad_ckpt)
        dense *= (1 - f) + f / fp8_gain(s.hidden_size)
    if head:
        dense += fused_loss_s(tokens, s.hidden_size, s.vocab_size, loss_const(w, tokens), trained=w.lora is None)
    # packed documents: their own length (Workload.attended); width: query heads x head dim (not always the hidden).
    # A sliding-window layer on the varlen kernel (packed rows; unpadded rows of a fine-tune: runtime/attention) sees at
    # most `window` keys a query, the causal work of rows 2 x window long (the planner counts causal work as full);
    # eager attention computes the whole row
    width, t_att = s.num_heads * s.head_dim, w.attended
    t_win = min(t_att, 2 * s.sliding_window) if s.sliding_window and run_attention(s, w.attn) != "eager" else t_att

    runs = (fwd_calls + 2.0 * grad_calls) / 3  # a forward and backward's attention work (4 + 8) at each call

    def layers_s(n: int, t: float, width: int = width, head_dim: int = s.head_dim) -> float:
        return n * tokens * width * t * (12.0 * runs / attention_rates.rate(head_dim, t) + forwards * 4.0 /
                                         attention_rates.rate(head_dim, t, backward=False))

    if s.layer_heads:  # heads or head dims set per layer (Gemma 4; BLT's stacks): each layer at its own
        # a layer over a share r of the row's positions (BLT's global stack: one a patch) attends r x the keys from r x
        # the queries. BLT's cross-attention modules (a row's bytes against its patches, and back) are not timed: about
        # a tenth of its global stack's attention at patch_size 4, which this counts at the kernel's causal rate
        attention = sum(layers_s(1, t_win if windowed else t_att, heads * dim, dim) if r == 1 else
                        r * layers_s(1, r * (t_win if windowed else t_att), heads * dim, dim)
                        for (heads, dim, windowed), r in zip(s.layer_heads, layer_shares(s), strict=True))
    else:
        attention = layers_s(s.num_layers - s.sliding_layers, t_att) + layers_s(s.sliding_layers, t_win)
    micro = dense + attention
    if w.load_in_4bit:  # each quantized Linear's dequantize-then-matmul, per call
        micro += calls * len(s.linears) * BNB4_CALL_S
    host = 0.0  # host time per micro-step the GPU waits on: ZeRO-3's fetch and release of each module or layer
    if c.stage == 3 and not leaves(w, c.stage):
        # the gathers ride inside the hooks' host time as fitted (one and two GPUs); not measured across nodes
        host = _hook_time_s(w, c, hw, offload_param) * layer_passes(s, c.grad_ckpt)
    elif c.stage == 3:
        host = calls * _leaf_s(hw.world, s.layer_modules)
        if hw.world > 1:  # one rank gathers from no other: Mistral-7B (8 layers) at ZeRO-3 ran at ZeRO-2's speed
            # the layers gathered again at each further call (not the embedding and head)
            micro += ZERO3_S_PER_GPARAM * (p_all + s.layers_numel * (layer_passes(s, c.grad_ckpt) - 1)) / 1e9
        if offload_param:
            # each rank copies its partition of every layer to the GPU in forward and again in backward
            micro += (3 if ckpt else 2) * layer_passes(s, ckpt) * 2.0 * p_all / hw.world / PCIE_BYTES_PER_S
    if w.reference == "engine":  # the frozen ZeRO-3 copy gathers every layer for its forward (objectives/reference.py)
        if hw.world > 1:  # as the policy's: one rank gathers from no other
            micro += ZERO3_S_PER_GPARAM * p_all / 1e9 / 3
        from toolkit.plan.speedups import reference_leaves

        as_leaves = reference_leaves(w.zero3_leaves, model_type=s.model_type, objective=w.objective)
        host += s.num_layers * (fwd_calls - reversible(s)) * (_leaf_s(hw.world, s.layer_modules) if as_leaves
                                                              else _modules(s)[0] * ZERO3_HOOK_S)
    micro = max(micro, host)
    if split_by_hooks(w, c.stage):  # measured against eager with the same hooks
        micro /= ZERO3_COMPILED_SPEED
    step = c.grad_accum * micro
    if c.stage < 3 and w.lora is None:  # the host's work of the step, which the GPU waits on where it is longer
        step = max(step, c.grad_accum * calls / 2 * HOST_LAYER_S + HOST_STEP_S)
    if w.optimizer == "muon" and w.lora is None:  # LoRA's adapters are r-wide: their Newton-Schulz is negligible
        step += muon_step_s(s, c.stage, hw.world)
    if offload_opt:
        # every rank of a node shares the host's cores for DeepSpeedCPUAdam; the measured rate includes
        # the gradient and parameter copies
        step += cpu_params * hw.gpus_per_node / CPU_ADAM_PARAMS_PER_S
    return step / MEMORY_SIZES_SPEED[c.stage] if c.zero_sizes == "memory" else step


def checkpoint_input_bytes(s: ModelShape) -> float:
    """Bytes a token a checkpointed decoder layer keeps: its input, 2 x hidden (bf16); or where the stacks have their
    own widths and token counts (BLT) the mean over the layers of each stack's traced input (its global stack's layers
    take one 2,048-wide position a patch: 1,024 bytes a byte at patch_size 4, where its local layers take 2,048) and
    what the modules run beside a layer save (its cross-attention, which checkpointing does not run again; traced
    full fine-tune, an upper bound under LoRA)."""
    stacks = (s.trace or {}).get("stacks")
    if not stacks:
        return 2.0 * s.hidden_size
    return sum(st[0] * (st[2] + (st[4] if len(st) > 4 else 0.0)) for st in stacks) / sum(st[0] for st in stacks)


def layer_shares(s: ModelShape) -> list[float]:
    """Each decoder layer's positions over the row's tokens: 1, or where the stacks run at their own counts (BLT) each
    stack's, as traced (its global stack: 1 / patch_size)."""
    stacks = (s.trace or {}).get("stacks")
    if not stacks:
        return [1.0] * s.num_layers
    return [share for layers, share, *_ in stacks for _ in range(layers)]


def layer_calls(s: ModelShape) -> tuple[float, float]:
    """Each decoder layer's calls a forward, (all, those with gradients), as the trace counted them: (1, 1) but where
    the model runs its layers more than once (HRM: its low-level stack 6 times a forward, 3 with gradients, its
    high-level one twice: 4 and 2.5 a layer)."""
    calls = (s.trace or {}).get("calls")
    return (float(calls[0]), float(calls[1])) if calls else (1.0, 1.0)


def run_attention(s: ModelShape, attn: str) -> str:
    """The attention a run takes when asked for `attn`: eager where transformers has no sdpa path for a model with
    attention heads (ModelShape.sdpa; toolkit/runtime/attention.plan decides the same)."""
    return "eager" if attn in ("sdpa", "varlen") and not s.sdpa and s.num_heads else attn  # Mamba: no attention


def reversible(s: ModelShape) -> bool:
    """Reversible layers (Reformer): the trace saw no layer call with gradients and traced one layer's recompute."""
    return bool((s.trace or {}).get("recompute"))


def recompute_bytes(s: ModelShape, *, liger: bool, lora: Lora | None) -> float:
    """Reversible layers (Reformer, traced: no layer call with gradients in forward): what one layer's recompute in
    backward keeps a token, the largest of its parts; 0 for any other model."""
    rec = (s.trace or {}).get("recompute")
    return float(rec[f"{'liger' if liger else 'plain'}-{'full' if lora is None else 'frozen'}"]) if rec else 0.0


def layer_passes(s: ModelShape, grad_ckpt: bool) -> float:
    """A step's layer calls (forward, backward, checkpointing's recompute) over those of layers run once."""
    fwd, grad = layer_calls(s)
    grad_ckpt = grad_ckpt and not reversible(s)
    return (fwd + grad * (1 + grad_ckpt)) / (2 + grad_ckpt)


def _modules(s: ModelShape, lora: Lora | None = None) -> tuple[int, int, int]:
    """(modules with parameters in a decoder layer, those in its MLP, the MLP's parameters); under LoRA each targeted
    Linear holds two more (PEFT's lora_A and lora_B)."""
    owners = s.layer_owners
    mlp = {o for o in owners if o.startswith("mlp.")}
    extra = {o for o in owners if lora is not None and o.rsplit(".", 1)[-1] in lora.targets}
    n_mlp = len(mlp) + 2 * len(extra & mlp)
    return len(owners) + 2 * len(extra), n_mlp, sum(n for name, n in s.layer_params if name.startswith("mlp."))


def _hook_time_s(w: Workload, c: Choice, hw: Hardware, offload_param: bool) -> float:
    """Host seconds per micro-step of ZeRO-3's hooks on every submodule: each call of a module with parameters in
    forward and backward, and under tiled MLPs each tile's call of the MLP's modules (its forward without gradients,
    checkpointing's recompute, its backward), plus, with parameters on the CPU, every such call's copy of the module's
    partition to the GPU (DeepSpeed releases it after each call)."""
    s = w.shape
    owners, mlp_owners, mlp_numel = _modules(s, w.lora)
    if tiles_mlp(w):  # each tile: ceil(row tokens / hidden) of them
        mlp_calls = math.ceil(w.seq_len / w.sequence_parallel / s.hidden_size) * (2 + c.grad_ckpt)
    else:
        mlp_calls = 2
    calls = s.num_layers * (2 * (owners - mlp_owners) + mlp_calls * mlp_owners)
    host = calls * ZERO3_HOOK_S
    if offload_param:
        fetched = s.num_layers * (2 * (s.layer_numel - mlp_numel) + mlp_calls * mlp_numel)
        host += 2.0 * fetched / hw.world / PCIE_BYTES_PER_S
    return host


# -- candidates and the choice --------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(w: Workload, hw: Hardware, *, stages: Iterable[int] = (0, 1, 2, 3),
            offloads: Iterable[Offload] = OFFLOADS, micro_batches: Iterable[int] | None = None,
            grad_ckpt: Iterable[bool] = (False, True), zero_sizes: Iterable[str] = ("speed", "memory")) -> list[Choice]:
    """Every combination worth predicting. The global batch fixes micro x accumulation per rank."""
    per_rank = per_rank_batch(w.global_batch, hw.world // w.sequence_parallel)
    micros = [m for m in (micro_batches or divisors(per_rank)) if per_rank % m == 0]
    if not w.shape.checkpointing:  # transformers has none for it (Reformer: its reversible layers recompute anyway)
        grad_ckpt = [False]
    out: list[Choice] = []
    for stage in stages:
        if stage == 0 and w.sequence_parallel > 1:
            continue  # refused: DeepSpeed's Ulysses crashes at ZeRO-0
        if stage != 3 and w.expert_parallel > 1:
            continue  # AutoEP is modelled at ZeRO-3 only
        if stage == 0 and w.states == "bf16":
            continue  # DeepSpeed keeps bf16 master weights and states in its ZeRO optimizer only
        for off in offloads:
            if (off == "optimizer" and stage == 0) or (off == "all" and stage != 3):
                continue
            if off != "none" and w.states == "bf16" and w.optimizer == "muon":
                continue  # offloaded bf16 masters need DeepSpeedCPUAdam, which Muon is not (checks/muon.py)
            for ratio in (RATIOS if (off == "optimizer" and stage == 3) else (1.0,)):
                for m in micros:
                    for ck in grad_ckpt:
                        for zs in zero_sizes:
                            out.append(Choice(stage, off, ratio, m, per_rank // m, ck, zs))
    return out


def _check_expert_parallel(s: ModelShape, ep: int, world: int, stage: int) -> None:
    """AutoEP's own rules (deepspeed/module_inject/auto_ep: autoep_size divides the experts and the ranks), and the
    planner's: it models AutoEP at ZeRO-3, where the toolkit measured it."""
    if not s.num_experts:
        raise ConfigError(f"expert parallelism (AutoEP) needs a Mixture-of-Experts model; {s.model_type!r} has no experts")
    if s.num_experts % ep:
        raise ConfigError(f"autoep_size {ep} does not divide the model's {s.num_experts} experts")
    if world % ep:
        raise ConfigError(f"autoep_size {ep} does not divide the {world} ranks")
    if ep != world:  # smaller groups still gather each expert over the ranks that share it (auto_ep_layer.py)
        raise ConfigError(f"toolkit plan models AutoEP with autoep_size equal to the ranks ({world}, as measured), "
                          f"not {ep}")
    if stage != 3:
        raise ConfigError("toolkit plan models AutoEP at ZeRO-3 (where it was measured), not at ZeRO-" + str(stage))


def per_rank_batch(global_batch: int, world: int) -> int:
    if world < 1:
        raise ConfigError(f"need at least one GPU, got {world}")
    if global_batch < world or global_batch % world:
        raise ConfigError(f"global batch {global_batch} does not split evenly over {world} ranks")
    return global_batch // world


def rank(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Fitting first, fastest first; among equals the smaller GPU need."""
    return sorted(predictions, key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu, p.gpu_need_gib))


def plan(w: Workload, hw: Hardware, **limits: Any) -> list[Prediction]:
    """Predict every choice and rank them; a choice that needs memory sizes only where the speed sizes
    do not fit (the memory-lean sizes cost speed, DESIGN.md: chosen only when memory is tight)."""
    if w.lora is not None:
        check_lora_targets(w.shape, w.lora)
    if w.sequence_parallel > 1:
        from toolkit.config.checks.sequence import problems

        found = problems(w.sequence_parallel, hw.world, heads=w.shape.num_heads, kv_heads=w.shape.num_kv_heads,
                         seq_len=w.seq_len, attn=run_attention(w.shape, w.attn))
        if found:
            raise ConfigError("; ".join(found))
    if w.shape.max_positions is not None and w.seq_len > w.shape.max_positions:
        from toolkit.config.models import positions_hint

        raise ConfigError(f"sequence length {w.seq_len} is above the model's {w.shape.max_positions} positions; "
                          + positions_hint(w.shape.max_positions).replace("model.rope_factor", "--rope-factor"))
    if w.shape.train_seq and w.seq_len != w.shape.train_seq:
        raise ConfigError(f"model type {w.shape.model_type!r} trains only at rows of {w.shape.train_seq} tokens, the "
                          f"product of its axial positions (axial_pos_shape; transformers refuses any other length in "
                          f"training): plan --seq {w.shape.train_seq}, or a config whose axial_pos_shape multiplies to "
                          f"{w.seq_len}")
    preds = [predict(w, c, hw) for c in choices(w, hw, **limits)]
    speed_fits = {_key(p.choice) for p in preds if p.choice.zero_sizes == "speed" and p.fits}
    kept = [p for p in preds if p.choice.zero_sizes == "speed"
            or (p.fits and _key(p.choice) not in speed_fits)]
    return rank(kept)


# Predicted speeds closer than this are one speed in practice (the speed model is rough, and repeated
# runs of one configuration spread 9%, bench/results/speed.md); among them the planner takes the one
# with the fewest moving parts, then the most GPU headroom.
SPEED_TIE = 0.05
# An offloading choice (optimizer, parameters or activations to the host) wins over one without only by more than
# this: the speed model's error on offload rows. A Qwen2.5-1.5B shape at 262K tokens on an H200 predicted ZeRO-3 with
# everything on the CPU at 3,122 tokens/s and ZeRO-0 at 3,196; they ran at 2,455 and 4,429 (issue 50), and the old
# rule (the smaller GPU need within SPEED_TIE) took the offload.
OFFLOAD_MARGIN = 0.15


def moving_parts(p: Prediction) -> int:
    """What a choice moves to the host and back each step: the optimizer's states, the parameters, the layers'
    inputs (0: everything stays on the GPU)."""
    c = p.choice
    return int(c.offload != "none") + int(c.offload == "all") + int(bool(p.activation_offload))


def best(ranked: Sequence[Prediction]) -> Prediction | None:
    """The choice, among those that fit: without offload where one fits, unless an offload is predicted faster by more
    than OFFLOAD_MARGIN; then the fastest, or one within SPEED_TIE of it with fewer moving parts, then a smaller GPU
    need (`why_chosen` says which rule decided)."""
    return _best(ranked)[0]


# The speed model's measured range (bench/results/speed_model/README.md): hidden sizes from 896 (Qwen2-0.5B, ZeRO-2 and
# ZeRO-3 leaves within 13%: narrow/) to 4,096 (Mistral-7B, Llama-3-8B), one node of up to 4 GPUs. GPT-2 (hidden 768)
# ran up to 30% off its predicted speeds at one micro-step a step (ZeRO-0, ZeRO-2): its GPU work is as predicted, but
# the step waits on the host (kernel launches, the optimizer step's per-parameter work) more than the planner's host
# step says.
VALIDATED_HIDDEN = 896


def speed_caveat(w: Workload, hw: Hardware) -> str | None:
    """Where the plan's tokens/s were not validated, one line saying so (its peaks hold further: 1.8% on GPT-2)."""
    why = []
    if w.shape.hidden_size < VALIDATED_HIDDEN:
        why.append(f"hidden {w.shape.hidden_size:,} is below the {VALIDATED_HIDDEN:,} validated (GPT-2, 768, ran up "
                   "to 30% off the prediction at ZeRO-0/2: host-bound)")
    if hw.nodes > 1 or hw.world not in ZERO3_LEAF_S:
        why.append(f"{hw.world} GPUs on {hw.nodes} node(s) were not measured (1, 2 and 4 GPUs of one node were)")
    if w.load_in_4bit:
        why.append("a 4-bit base's dequantization cost is fitted on one llama-1b row (BNB4_CALL_S a Linear call), "
                   "not validated on other shapes")
    if not w.shape.num_heads:
        why.append("a state-space model (no attention heads): its Linears are counted, its scan's time is not, and "
                   "none was run")
    if run_attention(w.shape, w.attn) == "eager" and w.shape.num_heads:
        why.append("eager attention" + (f" ({w.shape.model_type!r} has no sdpa path in transformers)"
                                         if w.attn != "eager" else "") + " is timed at the fused kernels' rates; it "
                   "runs slower, by how much was not measured")
    patch = (w.shape.trace or {}).get("patch_bytes")
    if patch:
        why.append(f"its global stack runs once a patch, planned at {patch} byte{'s' * (patch > 1)} a patch "
                   "(patch_size where its entropy patcher picks them; one a byte without it): the patcher picks them "
                   "from the data, and a row of higher entropy (or a patcher at random init) makes more, up to one a "
                   "byte, whose global stack holds and runs more than planned; BLT-1B's shape at one a byte on one "
                   "H200 planned its peaks within 0.5%, its tokens/s 2% fast at micro 16 with checkpointing and 20% "
                   "and 33% fast at micro 4 and 2 (0.13 s a step more than planned)")
    if reversible(w.shape):
        why.append("reversible layers, each run again in backward from its outputs (traced): counted; Reformer-16K on "
                   "one H200 planned its tokens/s 3% and 10% fast")
    elif layer_calls(w.shape) != (1.0, 1.0):
        fwd, grad = layer_calls(w.shape)
        why.append(f"its layers run {fwd:g} times a forward, {grad:g} with gradients (traced): counted at every call; "
                   "HRM-Text-1B on one H200 planned its peaks within 0.1% and its tokens/s 2% to 39% slow (ZeRO-3's "
                   "hooks at every call)")
    return ("tokens/s not validated here: " + "; ".join(why) + " (bench/results/speed_model/)") if why else None


def why_chosen(ranked: Sequence[Prediction]) -> str:
    """One line: why `best` took its choice."""
    return _best(ranked)[1]


def _best(ranked: Sequence[Prediction]) -> tuple[Prediction | None, str]:
    fitting = [p for p in ranked if p.fits]
    if not fitting:
        return None, "nothing fits"
    top = max(p.tokens_per_s_per_gpu for p in fitting)
    plain = [p for p in fitting if not moving_parts(p)]
    plain_top = max((p.tokens_per_s_per_gpu for p in plain), default=0.0)
    if plain and top <= (1 + OFFLOAD_MARGIN) * plain_top:
        pool = plain
        why = ("no offload: one fits" + (f", and no offload is predicted more than {OFFLOAD_MARGIN:.0%} faster"
                                         if top > plain_top else ""))
    else:
        pool = fitting
        why = ("offload: no choice without it fits" if not plain else
               f"offload: predicted {top / plain_top:.2f}x the fastest choice without it (> {1 + OFFLOAD_MARGIN:g}x)")
    pool_top = max(p.tokens_per_s_per_gpu for p in pool)
    close = [p for p in pool if p.tokens_per_s_per_gpu >= (1 - SPEED_TIE) * pool_top]
    # equal predictions for ZeRO-1 and ZeRO-2 (the same buffers here): take ZeRO-2, the measured one
    chosen = min(close, key=lambda p: (moving_parts(p), round(p.gpu_need_gib, 1), -p.tokens_per_s_per_gpu,
                                       p.choice.stage == 1))
    if len(close) > 1:
        why += f"; {len(close)} within {SPEED_TIE:.0%} of the fastest: the fewest moving parts, then the smallest GPU need"
    else:
        why += "; the fastest"
    return chosen, why


def _key(c: Choice) -> tuple[Any, ...]:
    return (c.stage, c.offload, c.ratio, c.micro_batch, c.grad_ckpt)


# -- the API other parts of the toolkit call ---------------------------------------------------------


def choice_from_ds(ds: dict[str, Any], *, micro_batch: int, grad_accum: int, grad_ckpt: bool,
                   zero_sizes: str = "speed") -> Choice:
    """The Choice a DeepSpeed dict (raw, "auto" allowed, or resolved) describes."""
    from toolkit.config.ds_config import zero_stage

    zero = ds.get("zero_optimization") or {}
    stage = zero_stage(ds)
    opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    par = (zero.get("offload_param") or {}).get("device", "none")
    if "nvme" in (opt, par):
        raise ConfigError("toolkit plan does not model NVMe offload")
    offload: Offload = "all" if (par == "cpu" and stage == 3) else "optimizer" if opt == "cpu" and stage >= 1 else "none"
    ratio = float((zero.get("offload_optimizer") or {}).get("ratio", 1.0)) if offload != "none" else 1.0
    return Choice(stage, offload, ratio, micro_batch, grad_accum, grad_ckpt, zero_sizes)


def autoep_size(ds: dict[str, Any], world_size: int, shape: ModelShape) -> int:
    """The AutoEP degree the planner models for a run's DeepSpeed dict: its autoep_size (DeepSpeed's default 1) where
    the planner's rules take it (`_check_expert_parallel`), else 1: the plan of the same run without AutoEP, which
    over-estimates its peak."""
    from toolkit.config.checks.expert_parallel import KEY, enabled
    from toolkit.config.ds_config import zero_stage

    size = ds[KEY].get("autoep_size", 1) if enabled(ds) else 1
    if not isinstance(size, int) or size <= 1:
        return 1
    try:
        _check_expert_parallel(shape, size, world_size, zero_stage(ds))
    except ConfigError:
        return 1
    return size


def run_settings(cfg: Any, compiled: bool, tiled_mlp: bool) -> dict[str, Any]:
    """fitting_micro_batches' keyword arguments as a run's config (toolkit/config/schema.py Config) sets them; compiled,
    tiled_mlp: train.compile and model.tiled_mlp as the run resolved them (toolkit/runtime/resolved.py)."""
    m, t = cfg.model, cfg.train
    return {"lora": Lora(cfg.lora.r, tuple(cfg.lora.target_modules)) if cfg.lora.enabled else None,
            "grad_ckpt": m.gradient_checkpointing, "liger": m.liger, "attn": m.attn_implementation,
            "zero_sizes": t.zero_sizes, "fused_loss": m.liger_fused_loss, "compile": "torch" if compiled else "off",
            "fp8": t.fp8_recipe if t.precision == "fp8" else None,
            "tiled_mlp": tiled_mlp,
            "activation_offload": m.activation_offload, "tiled_loss": m.tiled_loss,
            "objective": t.objective, "reference": _reference_of(cfg), "zero3_leaves": t.zero3_leaves,
            "loss_chunks": m.liger_chunk_mem_const}


def _reference_of(cfg: Any) -> str:
    """pref.reference as the run resolves it (runtime/objectives/reference.mode_of); none for SFT, reference-free
    runs and GRPO without a KL term."""
    if cfg.train.objective == "grpo" and not cfg.rl.beta:
        return "none"
    return reference_mode(cfg.train.objective, cfg.pref.reference, bool(cfg.lora.enabled))


def reference_mode(objective: str, requested: str, lora: bool) -> str:
    """A run's reference as runtime/objectives/reference.mode_of resolves pref.reference (auto: the base with the
    adapters off under LoRA, else the ZeRO-3 engine); none for SFT, the reference-free objectives, and GRPO's auto
    (rl.beta = 0)."""
    if objective in ("sft", *REFERENCE_FREE_OBJECTIVES) or (objective == "grpo" and requested == "auto"):
        return "none"
    if requested == "adapter" and not lora:
        raise ConfigError("--reference adapter needs --lora (the reference is the base with the adapters off)")
    if requested == "auto":
        return "adapter" if lora else "engine"
    return requested


def fitting_micro_batches(*args: Any, **kwargs: Any) -> list[int]:
    """Micro-batch sizes (divisors of per_rank_batch = micro x grad_accum) predicted to fit in gpu_mem_gib per GPU
    for this DeepSpeed config, largest first; [] when none does. The arguments are micro_batch_needs'."""
    return [m for m, _ in micro_batch_needs(*args, **kwargs)]


def micro_batch_needs(model_config: Any, ds_config: dict[str, Any], world_size: int, seq_len: int,
                      per_rank_batch: int, gpu_mem_gib: float, *, lora: Lora | bool | None = None,
                      grad_ckpt: bool = False, liger: bool = True, attn: str = "sdpa", zero_sizes: str = "speed",
                      fused_loss: str = "auto", gpus_per_node: int | None = None, compile: str = "off",
                      fp8: str | None = None, tiled_mlp: bool = False, activation_offload: str = "auto",
                      tiled_loss: str = "auto", objective: str = "sft", reference: str = "none",
                      zero3_leaves: str = "auto", loss_chunks: str = "auto") -> list[tuple[int, float]]:
    """(micro-batch, its planned GPU need in GiB, the allocator's margin and the CUDA context in) for each divisor of
    per_rank_batch (= micro x grad_accum) predicted to fit in gpu_mem_gib per GPU for this DeepSpeed config, largest
    first; [] when none does.

    model_config: an HF config object (train.py's RunSpec.model_config) or a ModelShape. The stage,
    offload and ratio come from ds_config; its bucket/live sizes follow zero_sizes, as "auto" does.
    lora: a Lora (r, target modules), True for the defaults (r=8 on q_proj, v_proj), or None/False.
    fused_loss: model.liger_fused_loss. compile: train.compile (off, torch, auto); fp8: the float8 recipe or None.
    tiled_mlp: model.tiled_mlp as the run resolved it; activation_offload: model.activation_offload; tiled_loss:
    model.tiled_loss. objective, reference: train.objective and pref.reference resolved (a preference run's
    per_rank_batch counts pairs). zero3_leaves: train.zero3_leaves. loss_chunks: model.liger_chunk_mem_const.
    Raises ConfigError for a model type without an activation model.
    """
    shape = model_config if isinstance(model_config, ModelShape) else _shape_of(model_config)
    gpn = gpus_per_node or world_size
    hw = Hardware(gpus_per_node=gpn, nodes=max(1, world_size // gpn), gpu_mem_gib=gpu_mem_gib)
    adapters = Lora() if lora is True else (lora or None)
    w = Workload(shape, seq_len, per_rank_batch * world_size, adapters, liger, attn, fused_loss, compile, fp8,
                 tiled_mlp=tiled_mlp, activation_offload=activation_offload, tiled_loss=tiled_loss,
                 expert_parallel=autoep_size(ds_config, world_size, shape), objective=objective, reference=reference,
                 zero3_leaves=zero3_leaves, loss_chunks=loss_chunks)
    out = []
    for m in sorted(divisors(per_rank_batch), reverse=True):
        c = choice_from_ds(ds_config, micro_batch=m, grad_accum=per_rank_batch // m, grad_ckpt=grad_ckpt,
                           zero_sizes=zero_sizes)
        p = predict(w, c, hw)
        if p.fits_gpu:
            out.append((m, p.gpu_need_gib))
    return out


def _shape_of(model_config: Any) -> ModelShape:
    from toolkit.plan.shapes import shape_of_config

    return shape_of_config(model_config)
