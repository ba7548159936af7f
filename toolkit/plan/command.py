"""`toolkit plan`: the table of what fits, `--json`, and `-o DIR` (DeepSpeed JSON, training YAML,
plan.json). The arithmetic lives in toolkit/plan/planner.py; this module only reads arguments and writes.
No torch import: a 70B-shaped preset plans in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError, gen_config
from toolkit.config.models import PRESETS
from toolkit.plan import planner as pl

PLAN_VERSION = 1
# The keys every candidate carries (issue 11's --json contract), then the planner's extras.
CANDIDATE_KEYS = ("stage", "offload", "micro_batch", "grad_accum", "grad_ckpt", "liger", "gpu_peak_gib",
                  "host_gib", "fits")


def candidate_json(p: pl.Prediction) -> dict[str, Any]:
    """gpu_peak_gib: predicted peak allocated per rank; host_gib: host RAM per node (all its ranks)."""
    c = p.choice
    return {"stage": c.stage, "offload": c.offload, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
            "grad_ckpt": c.grad_ckpt, "liger": p.liger, "gpu_peak_gib": round(p.peak_allocated_gib, 3),
            "host_gib": round(p.host_node_gib, 3), "fits": p.fits,
            "offload_ratio": c.ratio if c.offload != "none" else None, "zero_sizes": c.zero_sizes,
            "fused_loss": p.fused_loss, "compiled": p.compiled, "gpu_need_gib": round(p.gpu_need_gib, 3),
            "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 1), "activation_offload": p.activation_offload}


# AutoEP's preset_model for the model types the planner knows (deepspeed 0.19.8 auto_ep_presets: qwen3_moe also
# covers Qwen2-MoE's fused layout; OLMoE needs its own layer pattern, so no preset is written for it)
EP_PRESETS = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe", "mixtral": "mixtral"}


def ds_config_for(c: pl.Choice, expert_parallel: int = 1, model_type: str = "", optimizer: str = "adamw",
                  states: str = "fp32") -> dict[str, Any]:
    """The chosen DeepSpeed JSON: a gen-config preset (training-owned values stay "auto") plus the ratio, and
    AutoEP's block where the plan has it."""
    cfg = gen_config(c.stage, offload_optimizer="cpu" if c.offload != "none" else "none",
                     offload_param="cpu" if c.offload == "all" else "none", optimizer=optimizer,
                     optimizer_states=states)
    if c.offload != "none" and c.ratio < 1.0:
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = c.ratio
    if expert_parallel > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": expert_parallel}
        if model_type in EP_PRESETS:
            cfg["expert_parallel"]["preset_model"] = EP_PRESETS[model_type]
    return cfg


def train_overrides(args: Any, p: pl.Prediction, out_dir: Path | None) -> dict[str, Any]:
    """Training-config values (section.key -> value) for the chosen candidate."""
    c = p.choice
    o: dict[str, Any] = {"model.name": args.model, "data.seq_len": args.seq,
                         "train.micro_batch_size": c.micro_batch, "train.grad_accum": c.grad_accum,
                         "model.gradient_checkpointing": c.grad_ckpt, "model.liger": not args.no_liger,
                         "model.attn_implementation": args.attn, "train.zero_sizes": c.zero_sizes,
                         "lora.enabled": bool(args.lora)}
    if args.fused_loss != "auto":
        o["model.liger_fused_loss"] = args.fused_loss
    if args.liger_chunk_mem_const != "auto":
        o["model.liger_chunk_mem_const"] = args.liger_chunk_mem_const
    if args.compile != "auto":
        o["train.compile"] = args.compile
    if args.zero3_leaves != "auto":
        o["train.zero3_leaves"] = args.zero3_leaves
    if args.precision == "fp8":
        o["train.precision"] = "fp8"
        o["train.fp8_recipe"] = args.fp8_recipe
    if args.task != "causal_lm":
        o["model.task"] = args.task
    if args.rope_factor != 1:
        o["model.rope_factor"] = args.rope_factor
    if args.layers:
        o["model.num_layers"] = args.layers
    if args.sequence_parallel > 1:
        o["train.sequence_parallel"] = args.sequence_parallel
        o["train.path"] = "raw"  # the path sequence parallelism was measured on (GPU rows); the Trainer's trains alike
    if args.tiled_mlp != "auto":
        o["model.tiled_mlp"] = args.tiled_mlp
    if args.tiled_loss != "auto":
        o["model.tiled_loss"] = args.tiled_loss
    if args.activation_offload != "auto":
        o["model.activation_offload"] = args.activation_offload
    if args.lora:
        o["lora.r"] = args.lora_r
        o["lora.target_modules"] = list(_targets(args))
    if args.load_in_4bit:
        o["model.load_in_4bit"] = True
    if args.objective == "grpo":
        o |= {"train.objective": "grpo", "data.seq_len": args.seq + args.completion, "rl.max_prompt_length": args.seq,
              "rl.max_completion_length": args.completion, "rl.num_generations": args.generations}
    if out_dir is not None:
        o["train.ds_config"] = str(out_dir / "ds_config.json")
        o["train.plan"] = str(out_dir / "plan.json")
    return o


def _targets(args: Any) -> tuple[str, ...]:
    return tuple(t for t in args.lora_targets.split(",") if t)


def _workload(args: Any) -> tuple[pl.Workload, pl.Hardware]:
    from toolkit.plan.shapes import load_shape

    checks = [(args.gpus >= 1, f"--gpus must be at least 1, got {args.gpus}"),
              (args.nodes >= 1, f"--nodes must be at least 1, got {args.nodes}"),
              (args.seq >= 8, f"--seq must be at least 8, got {args.seq}"),
              (args.global_batch >= 1, f"--global-batch must be at least 1, got {args.global_batch}"),
              (args.gpu_mem > 0, f"--gpu-mem must be positive, got {args.gpu_mem}"),
              (args.host_mem is None or args.host_mem > 0, f"--host-mem must be positive, got {args.host_mem}"),
              (args.lora_r >= 1, f"--lora-r must be at least 1, got {args.lora_r}"),
              (args.sequence_parallel >= 1, f"--sequence-parallel must be at least 1, got {args.sequence_parallel}"),
              (args.expert_parallel >= 1, f"--expert-parallel must be at least 1, got {args.expert_parallel}")]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    if args.expert_parallel > 1 and args.stage is not None and args.stage != 3:
        raise ConfigError(f"--expert-parallel: toolkit plan models AutoEP at ZeRO-3 (where it was measured), "
                          f"not with --stage {args.stage}")
    shape = load_shape(args.model)
    if args.expert_parallel > 1 and shape.num_experts and shape.model_type not in EP_PRESETS:
        raise ConfigError(f"--expert-parallel: DeepSpeed's AutoEP has no preset for {shape.model_type!r} (it has "
                          f"{', '.join(sorted(set(EP_PRESETS.values())))}); its layers need expert_parallel's own "
                          "layer pattern, which the plan does not write")
    if args.layers:  # every decoder layer has the same parameters: fewer layers, the same list
        if args.layers < 0:
            raise ConfigError(f"--layers must be at least 1, got {args.layers}")
        if args.model not in PRESETS:  # as model.num_layers: a directory's weights fix its layer count
            raise ConfigError(f"--layers applies to presets; {args.model} is a directory: its config.json's layer "
                              "count is what its weights hold")
        if (shape.trace or {}).get("stacks"):  # one count cannot cut stacks of their own widths alike
            raise ConfigError(f"--layers cuts one stack of decoder layers; {args.model} ({shape.model_type}) is built "
                              "of layer stacks of their own widths: set each stack's num_hidden_layers in a config")
        shape = dataclasses.replace(shape, num_layers=args.layers)
    if args.rope_factor < 1:
        raise ConfigError(f"--rope-factor must be at least 1, got {args.rope_factor}")
    if args.rope_factor != 1 and shape.max_positions is not None:  # rope scaling moves no memory or FLOPs
        shape = dataclasses.replace(shape, max_positions=int(shape.max_positions * args.rope_factor))
    lora = pl.Lora(args.lora_r, _targets(args)) if args.lora else None
    if args.task != shape.task:
        raise ConfigError(f"toolkit plan models {args.model} as {shape.task} (the task the toolkit trains it on), "
                          f"not {args.task}")
    if args.doc_len is not None and args.doc_len < 2:
        raise ConfigError(f"--doc-len must be at least 2 tokens, got {args.doc_len}")
    from toolkit.plan.speedups import tiled_mlp_on

    tiled = tiled_mlp_on(args.tiled_mlp, args.seq, args.sequence_parallel)[0]
    if args.zero3_leaves == "true" and lora is not None:  # as the run refuses it (speedups.leaves_on)
        raise ConfigError("--zero3-leaves true: under LoRA the decoder layers cannot be ZeRO-3 leaf modules (the first "
                          "layer's input needs no gradient); leave --zero3-leaves at auto")
    w = pl.Workload(shape, args.seq + _completion(args), args.global_batch, lora, not args.no_liger, args.attn, args.fused_loss,
                    args.compile, args.fp8_recipe if args.precision == "fp8" else None, args.doc_len,
                    args.sequence_parallel, tiled, args.activation_offload, args.tiled_loss,
                    expert_parallel=args.expert_parallel, objective=args.objective,
                    reference=pl.reference_mode(args.objective, args.reference, lora is not None),
                    generations=args.generations, completion_len=_completion(args), zero3_leaves=args.zero3_leaves,
                    optimizer=args.optimizer, states=args.optimizer_states, load_in_4bit=args.load_in_4bit,
                    quantized_build=args.load_in_4bit and _read_by_module(args.model),
                    loss_chunks=args.liger_chunk_mem_const)
    hw = pl.Hardware(args.gpus, args.nodes, args.gpu_mem, args.host_mem)
    return w, hw


def _read_by_module(model: str) -> bool:
    """A 4-bit base built or read module by module (runtime/quant build_4bit): a preset, or a directory whose
    safetensors hold the model's own tensor names; another directory is loaded whole first."""
    if model in PRESETS:
        return True
    from toolkit.hub import is_hub_id

    if is_hub_id(model):  # its index is not fetched for a plan: a repository of transformers' own names is the rule
        return True
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config.checkpoint import checkpoint_files, model_keys

    mc = AutoConfig.from_pretrained(model, local_files_only=True)
    return checkpoint_files(model, model_keys(AutoModelForCausalLM, mc, {})) is not None


def _chunk_setting(value: str) -> str:
    """--liger-chunk-mem-const: auto or a positive integer, as model.liger_chunk_mem_const takes it."""
    import argparse

    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"auto or a positive integer, got {value!r}")
    return value


def _completion(args: Any) -> int:
    """--completion for --objective grpo (its sequence is --seq prompt tokens plus these), else 0."""
    if args.objective != "grpo":
        return 0
    if args.completion is None or args.completion < 1 or args.generations < 2:
        raise ConfigError("--objective grpo plans prompts of --seq tokens with --generations (>= 2) completions of "
                          "--completion (>= 1) tokens each")
    return args.completion


def _model_type(model: str) -> str | None:
    """The model type from the preset or config.json, without building anything (None: unknown here)."""
    if model in PRESETS:
        return str(PRESETS[model]["model_type"])
    try:
        return str(json.loads((Path(model) / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # load_shape says what is wrong with it


def _limits(args: Any, hw: pl.Hardware, w: pl.Workload) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    if args.stage is not None:
        limits["stages"] = (args.stage,)
    if args.offload is not None:
        limits["offloads"] = (args.offload,)
    if args.micro_batch is not None:
        if hw.world % w.sequence_parallel:
            pl.plan(w, hw)  # the rules say what is wrong with the sequence-parallel degree, in their words
        groups = hw.world // w.sequence_parallel  # the ranks of a sequence-parallel group share its sequences
        per_rank = pl.per_rank_batch(w.global_batch, groups)
        if per_rank % args.micro_batch:
            raise ConfigError(f"--micro-batch {args.micro_batch} does not divide the {per_rank} sequences per rank "
                              f"(global batch {w.global_batch} over {groups} data-parallel ranks)")
        limits["micro_batches"] = (args.micro_batch,)
    if args.grad_ckpt or args.activation_offload in ("true", "pinned", "pageable"):
        if not w.shape.checkpointing:
            raise ConfigError(f"--grad-ckpt: transformers has no gradient checkpointing for {w.shape.model_type!r} "
                              "(Reformer's reversible layers recompute in backward already)")
        limits["grad_ckpt"] = (True,)  # offloaded inputs are checkpointing's (the config refuses one without it)
    return limits


def _nothing_fits(preds: list[pl.Prediction], hw: pl.Hardware) -> str:
    if not preds:
        return "nothing to plan: no stage / offload / micro-batch combination matches the options given"
    gpu_ok = [p for p in preds if p.fits_gpu]
    if gpu_ok:
        p = min(gpu_ok, key=lambda p: p.host_node_gib)
        return (f"nothing fits: every choice that fits the GPU needs at least {p.host_node_gib:.1f} GiB of host RAM "
                f"per node ({_describe(p.choice)}), above --host-mem {hw.host_mem_gib:g}; offload less, add nodes "
                "or raise --host-mem")
    p = min(preds, key=lambda p: p.gpu_need_gib)
    leaves = ""
    # planner._gathered_bytes: ZeRO-3 leaf layers with checkpointing kept every layer gathered where measured
    held = [q for q in preds if q.choice.stage == 3 and q.choice.grad_ckpt
            and q.gpu.get("gathered", 0.0) > q.peak_allocated_gib / 4]
    if held:
        q = min(held, key=lambda q: q.gpu_need_gib)
        leaves = (f"; or --zero3-leaves false (with checkpointing, {q.gpu['gathered']:.1f} GiB of ZeRO-3's peak is "
                  "every decoder layer gathered, as DeepSpeed keeps leaf layers)")
    return (f"nothing fits in {hw.gpu_mem_gib:g} GiB per GPU: the smallest need is {p.gpu_need_gib:.1f} GiB "
            f"({_describe(p.choice)}); add GPUs, raise --gpu-mem, shorten --seq, or train LoRA (--lora){leaves}")


def _describe(c: pl.Choice) -> str:
    off = {"none": "no offload", "optimizer": "optimizer offload", "all": "optimizer and parameter offload"}[c.offload]
    if c.offload != "none" and c.ratio < 1:
        off += f" (ratio {c.ratio:g}: {c.ratio * 100:g}% of the optimizer states on the CPU)"
    ck = ", gradient checkpointing" if c.grad_ckpt else ""
    sizes = ", train.zero_sizes=memory" if c.zero_sizes == "memory" else ""
    return f"ZeRO-{c.stage}, {off}, micro {c.micro_batch} x accum {c.grad_accum}{ck}{sizes}"


def _ckpt(p: pl.Prediction) -> str:
    """The table's checkpointing column: no, yes, or yes with the kept inputs in host buffers."""
    return ("yes, inputs on CPU" if p.activation_offload else "yes") if p.choice.grad_ckpt else "no"


def _offload_note(p: pl.Prediction) -> str:
    return f", checkpointed inputs on the CPU ({p.activation_offload})" if p.activation_offload else ""


def _fmt_offload(c: pl.Choice) -> str:
    if c.offload == "none":
        return "none"
    return c.offload + (f" {c.ratio:g}" if c.ratio < 1 else "")


def render(args: Any, w: pl.Workload, hw: pl.Hardware, ranked: list[pl.Prediction], chosen: pl.Prediction,
           top: int) -> str:
    s = w.shape
    trainable = pl.trainable_params(s, w.lora)
    kind = "full fine-tune" if w.lora is None else f"LoRA r={w.lora.r} on {','.join(w.lora.targets)}: {trainable / 1e6:.1f}M trained"
    host = f"{hw.host_mem_gib:g} GiB host RAM per node" if hw.host_mem_gib is not None else "host RAM not checked (--host-mem)"
    lines = [
        f"toolkit plan: {args.model} ({s.total_params / 1e9:.2f}B parameters, {kind}), {hw.gpus_per_node} GPU(s) x "
        f"{hw.nodes} node(s), {hw.gpu_mem_gib:g} GiB per GPU, {host}",
        (f"grpo: micro-batches of prompts x {w.generations} completions of up to {w.seq_len} tokens each (prompt "
         f"{w.seq_len - w.completion_len} + completion {w.completion_len}), packed; the rollout (the model gathered "
         f"under ZeRO-3, a static KV cache) counted in the peak; step times are the update's "
         f"(generation not modelled); reference: {w.reference}; " if w.objective == "grpo" else
         f"kto: micro-batches of rows, a completion and a mismatched one of up to {w.seq_len} tokens each, packed; "
         f"reference: {w.reference}; " if w.objective == "kto" else
         f"{w.objective}: micro-batches of pairs, chosen and rejected of up to {w.seq_len} tokens each, packed; "
         f"reference: {w.reference}; " if w.objective != "sft" else "")
        + f"sequence {w.seq_len}" + (f" packed with documents of {w.doc_len:g} tokens (token-weighted)" if w.doc_len else "")
        + (f" over {w.sequence_parallel} ranks each (sequence parallelism)" if w.sequence_parallel > 1 else "")
        + (", MLPs tiled" if w.tiled_mlp else "")
        + (f", experts over {w.expert_parallel} ranks (AutoEP)" if w.expert_parallel > 1 else "")
        + f", global batch {w.global_batch} ({w.global_batch * w.sequence_parallel // hw.world} per rank), "
        f"attention {pl.run_attention(w.shape, w.attn)}"
        + (f" (asked {w.attn}: transformers has no sdpa path for {w.shape.model_type!r})"
           if pl.run_attention(w.shape, w.attn) != w.attn else "") + ", "
        f"Liger {'off (train.objective=grpo)' if w.objective == 'grpo' else 'on where supported' if w.liger else 'off'}, "
        + (f"train.compile={w.compile} (auto: compiled; eager at ZeRO-3 under LoRA), " if w.objective == "sft" else
           "eager (preference and RL runs are not compiled), ") + (f"float8 matmuls ({w.fp8})" if w.fp8 else "bf16"),
        f"GPU need = predicted peak allocated x {1 + pl.ALLOC_MARGIN:.2f} + {pl.CUDA_CONTEXT_GIB} GiB CUDA context; "
        "host = RSS of all ranks of a node",
        "",
    ]
    fitting = [p for p in ranked if p.fits]
    rows = [["#", "stage", "offload", "micro x accum", "ckpt", "liger", "GPU peak", "GPU need", "host/node",
             "tokens/s/GPU", "fits"]]
    shown = fitting[:top] if fitting else ranked[:top]
    if chosen not in shown:
        shown = [chosen, *shown[:-1]]
    for i, p in enumerate(shown, 1):
        c = p.choice
        liger = ("fused" if p.fused_loss else "kernels") if p.liger else "off"
        rows.append([str(i) + ("*" if p is chosen else ""), str(c.stage) + (" (mem)" if c.zero_sizes == "memory" else ""),
                     _fmt_offload(c), f"{c.micro_batch} x {c.grad_accum}", _ckpt(p), liger,
                     f"{p.peak_allocated_gib:.1f}", f"{p.gpu_need_gib:.1f}", f"{p.host_node_gib:.1f}",
                     f"{p.tokens_per_s_per_gpu:,.0f}", "yes" if p.fits else "no"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(x.rjust(wd) if j >= 6 else x.ljust(wd) for j, (x, wd) in enumerate(zip(r, widths, strict=True))))
    lines.append(f"{len(fitting)} of {len(ranked)} choices fit (GiB per rank; fastest first, predicted; * = chosen; "
                 "(mem): train.zero_sizes=memory)")
    lines.append("")
    lines.append(f"chosen: {_describe(chosen.choice)}{_offload_note(chosen)}; predicted {chosen.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    lines.append(f"  why: {pl.why_chosen(ranked)}")
    caveat = pl.speed_caveat(w, hw)
    if caveat:
        lines.append(f"  speed: {caveat}")
    gpu = ", ".join(f"{k} {v:.2f}" for k, v in chosen.gpu.items() if v >= 0.005)
    lines.append(f"  GPU at its peak ({chosen.phase}): {gpu} = {chosen.peak_allocated_gib:.2f} GiB allocated")
    host_parts = ", ".join(f"{k} {v:.2f}" for k, v in chosen.host.items())
    build = (f"; {chosen.host_build_rank_gib:.2f} GiB while the model is built in fp32"
             if chosen.host_build_rank_gib > chosen.host_rank_gib else "")
    lines.append(f"  host per rank: {host_parts} = {chosen.host_rank_gib:.2f} GiB{build}")
    for hint in (fp8_hint(w, hw, chosen), states_hint(w, hw, chosen)):
        if hint:
            lines.append(hint)
    return "\n".join(lines)


def states_hint(w: pl.Workload, hw: pl.Hardware, chosen: pl.Prediction) -> str | None:
    """Where the plan offloads with fp32 optimizer states: what bf16 master weights and states would choose instead.
    Opt-in, like float8: they change the numerics (docs/optimizers.md has the measured cost)."""
    if w.states != "fp32" or chosen.choice.offload == "none":
        return None
    from dataclasses import replace

    alt_w = replace(w, states="bf16")
    # DeepSpeed keeps bf16 states at ZeRO 1-3, and offloaded bf16 masters only with its CPU Adam (not Muon's)
    alt = pl.best(pl.plan(alt_w, hw))
    if alt is None:
        return "  bf16 optimizer states: nothing would fit with them either"
    ratio = alt.tokens_per_s_per_gpu / chosen.tokens_per_s_per_gpu
    return (f"  bf16 optimizer states: off (bf16 master weights and states change the numerics: docs/optimizers.md); "
            f"--optimizer-states bf16 would choose {_describe(alt.choice)}{_offload_note(alt)}: "
            f"{alt.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {ratio:.2f}x, at {alt.peak_allocated_gib:.1f} GiB")


def fp8_hint(w: pl.Workload, hw: pl.Hardware, chosen: pl.Prediction) -> str | None:
    """For a bf16 plan: what float8 would give on the same choice (it stays opt-in: it changes numerics)."""
    if w.fp8 or w.lora is not None or w.shape.trace is None or w.shape.num_experts or w.objective != "sft":
        return None
    from dataclasses import replace

    alt = pl.predict(replace(w, fp8="tensorwise"), chosen.choice, hw)
    ratio = alt.tokens_per_s_per_gpu / chosen.tokens_per_s_per_gpu
    fits = "" if alt.fits else " (it would not fit)"
    return (f"  float8: off (it changes the matmuls' numerics: bench/results/fp8_ab/); --precision fp8 predicts "
            f"{alt.tokens_per_s_per_gpu:,.0f} tokens/s per GPU on this choice, {ratio:.2f}x, at "
            f"{alt.peak_allocated_gib:.1f} GiB{fits}")


def plan_json(args: Any, w: pl.Workload, hw: pl.Hardware, ranked: list[pl.Prediction],
              chosen: pl.Prediction | None, out_dir: Path | None) -> dict[str, Any]:
    s = w.shape
    data: dict[str, Any] = {
        "candidates": [candidate_json(p) for p in ranked],
        "chosen": None,
        "plan_version": PLAN_VERSION,
        "command": command(args),
        "inputs": {"model": args.model, "model_type": s.model_type, "params": s.total_params,
                   "trainable_params": pl.trainable_params(s, w.lora), "seq_len": w.seq_len,
                   "global_batch": w.global_batch, "gpus_per_node": hw.gpus_per_node, "nodes": hw.nodes,
                   "world_size": hw.world, "gpu_mem_gib": hw.gpu_mem_gib, "host_mem_gib": hw.host_mem_gib,
                   "lora": None if w.lora is None else {"r": w.lora.r, "targets": list(w.lora.targets)},
                   "load_in_4bit": w.load_in_4bit,
                   "liger": w.liger, "fused_loss": w.fused_loss, "loss_chunks": w.loss_chunks, "attn": w.attn,
                   "compile": w.compile,
                   "zero3_leaves": w.zero3_leaves,
                   "fp8": w.fp8, "task": w.shape.task, "doc_len": w.doc_len, "optimizer": w.optimizer,
                   "optimizer_states": w.states,
                   "sequence_parallel": w.sequence_parallel, "expert_parallel": w.expert_parallel,
                   "tiled_mlp": w.tiled_mlp,
                   "activation_offload": w.activation_offload},
        "constants": {"cuda_context_gib": pl.CUDA_CONTEXT_GIB, "alloc_margin": pl.ALLOC_MARGIN,
                      "host_baseline_gib": pl.HOST_BASELINE_GIB},
    }
    if chosen is not None:
        data["chosen"] = candidate_json(chosen) | {
            "why": pl.why_chosen(ranked),
            "speed_caveat": pl.speed_caveat(w, hw),
            "phase": chosen.phase,
            "gpu_breakdown_gib": chosen.gpu,
            "persistent_gib": chosen.persistent,
            "host_rank_gib": chosen.host_rank_gib,
            "host_breakdown_gib": chosen.host,
            "step_time_s": chosen.step_time_s,
            "ds_config": ds_config_for(chosen.choice, w.expert_parallel, w.shape.model_type, w.optimizer, w.states),
            "train_overrides": train_overrides(args, chosen, out_dir),
        }
    return data


def command(args: Any) -> str:
    """The plan's command line, rebuilt from its arguments (recorded in plan.json and train.yaml)."""
    parts = ["toolkit", "plan", "--model", args.model, "--gpus", str(args.gpus),
             *(["--max-seq"] if getattr(args, "max_seq", False) else ["--seq", str(args.seq)]),
             "--global-batch", str(args.global_batch), "--gpu-mem", f"{args.gpu_mem:g}"]
    if args.nodes != 1:
        parts += ["--nodes", str(args.nodes)]
    if args.layers:
        parts += ["--layers", str(args.layers)]
    if args.host_mem is not None:
        parts += ["--host-mem", f"{args.host_mem:g}"]
    if args.lora:
        parts += ["--lora", "--lora-r", str(args.lora_r), "--lora-targets", args.lora_targets]
    flags = (("--grad-ckpt", args.grad_ckpt), ("--no-liger", args.no_liger), ("--load-in-4bit", args.load_in_4bit))
    parts += [f for f, on in flags if on]
    for flag, value, default in (("--sequence-parallel", args.sequence_parallel, 1),
                                 ("--expert-parallel", getattr(args, "expert_parallel", 1), 1),
                                 ("--tiled-mlp", args.tiled_mlp, "auto"),
                                 ("--tiled-loss", args.tiled_loss, "auto"),
                                 ("--activation-offload", args.activation_offload, "auto"),
                                 ("--rope-factor", f"{args.rope_factor:g}", "1"), ("--fused-loss", args.fused_loss, "auto"),
                                 ("--liger-chunk-mem-const", args.liger_chunk_mem_const, "auto"), ("--attn", args.attn, "sdpa"),
                                 ("--compile", args.compile, "auto"), ("--zero3-leaves", args.zero3_leaves, "auto"),
                                 ("--precision", args.precision, "bf16"),
                                 ("--optimizer", args.optimizer, "adamw"),
                                 ("--optimizer-states", args.optimizer_states, "fp32"),
                                 ("--fp8-recipe", args.fp8_recipe, "tensorwise"), ("--task", args.task, "causal_lm"),
                                 ("--stage", args.stage, None), ("--offload", args.offload, None),
                                 ("--micro-batch", args.micro_batch, None), ("-o", args.output, None)):
        if value != default:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(x) for x in parts)


def write_plan(out_dir: Path, data: dict[str, Any], force: bool) -> list[Path]:
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"ds_config.json": out_dir / "ds_config.json", "train.yaml": out_dir / "train.yaml",
             "plan.json": out_dir / "plan.json"}
    existing = [str(p) for p in files.values() if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} exist; pass --force to overwrite")
    chosen = data["chosen"]
    files["ds_config.json"].write_text(json.dumps(chosen["ds_config"], indent=2) + "\n")
    nested: dict[str, Any] = {}
    for key, value in chosen["train_overrides"].items():
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    header = (f"# written by: {data['command']}\n# deepspeed --num_gpus {data['inputs']['gpus_per_node']} "
              f"toolkit/train.py --config {files['train.yaml']}   (or ./launch.sh --plan {out_dir})\n")
    files["train.yaml"].write_text(header + yaml.safe_dump(nested, sort_keys=False))
    files["plan.json"].write_text(json.dumps(data, indent=1) + "\n")
    return list(files.values())


def run_plan(args: Any) -> int:
    if args.max_seq:
        return _run_max_seq(args)
    if args.seq is None:
        raise ConfigError("toolkit plan needs --seq L (or --max-seq: the longest length each choice fits)")
    w, hw = _workload(args)
    ranked = pl.plan(w, hw, **_limits(args, hw, w))
    chosen = pl.best(ranked)
    if chosen is None:
        print(f"error: {_nothing_fits(ranked, hw)}", file=sys.stderr)
        return 1
    out_dir = Path(args.output) if args.output else None
    data = plan_json(args, w, hw, ranked, chosen, out_dir)
    if args.json:
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        print(render(args, w, hw, ranked, chosen, args.top))
    if out_dir is not None:
        written = write_plan(out_dir, data, args.force)
        msg = (f"wrote {', '.join(str(p) for p in written)}\nrun it: ./launch.sh --plan {out_dir}   "
               f"(or: deepspeed --num_gpus {hw.gpus_per_node} toolkit/train.py --config {out_dir / 'train.yaml'})")
        print(msg, file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_max_seq(args: Any) -> int:
    from toolkit.plan import max_seq

    if args.output:
        raise ConfigError("--max-seq plans no run to write (-o): plan one of its lengths with --seq")
    args.seq = 1024 * args.sequence_parallel  # the search's first step; _workload checks the rest
    w, hw = _workload(args)
    rows = max_seq.search(w, hw, args.tiled_mlp, **_limits(args, hw, w))
    if args.json:
        sys.stdout.write(json.dumps({"command": command(args), "longest": max_seq.to_json(rows)}, indent=1) + "\n")
    else:
        s = w.shape
        print(f"toolkit plan --max-seq: {args.model} ({s.total_params / 1e9:.2f}B parameters"
              + (", LoRA" if w.lora else ", full fine-tune") + f"), {hw.gpus_per_node} GPU(s) x {hw.nodes} node(s), "
              f"{hw.gpu_mem_gib:g} GiB per GPU, global batch {w.global_batch}"
              + (f", sequence parallelism over {w.sequence_parallel}" if w.sequence_parallel > 1 else "")
              + f", model.tiled_mlp={args.tiled_mlp}, model.activation_offload={args.activation_offload}\n")
        print(max_seq.render(rows, args.top, lambda p: _describe(p.choice) + _offload_note(p)))
    return 0 if rows else 1


def add_parser(sub: Any) -> None:
    """The `plan` subcommand's arguments (cli.py calls this)."""
    p = sub.add_parser(
        "plan", help="what fits per rank before launch: stage, offload, micro-batch, checkpointing",
        description="Predict per-rank GPU peak and host RAM for every ZeRO stage x offload x micro-batch x "
                    "checkpointing choice from the model's shape (no weights, no GPU), print what fits fastest "
                    "first, and write the chosen DeepSpeed JSON and training config with -o.")
    p.add_argument("--model", required=True, help="a preset (toolkit/runtime/model.py) or a local HF model directory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--layers", type=int, default=0,
                   help="plan the model with this many decoder layers (model.num_layers: a preset at full width, "
                        "fewer layers); default: its own")
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80; an H200 has 139)")
    p.add_argument("--host-mem", type=float, default=None, help="host RAM per node, GiB (default: not checked)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--max-seq", action="store_true",
                   help="instead of --seq: the longest sequence each choice fits (steps of 1,024 x --sequence-parallel)")
    p.add_argument("--global-batch", type=int, required=True,
                   help="sequences per optimizer step, all ranks (pairs, for a preference objective)")
    p.add_argument("--objective", choices=("sft", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"), default="sft",
                   help="train.objective: a preference objective plans micro-batches of pairs (two sequences of "
                        "--seq each; kto: a completion and a mismatched one) and the reference model; grpo plans prompts of --seq tokens, their "
                        "--generations completions of --completion tokens, and the rollout")
    p.add_argument("--generations", type=int, default=8, help="grpo: completions a prompt (rl.num_generations)")
    p.add_argument("--completion", type=int, default=None,
                   help="grpo: tokens a completion at most (rl.max_completion_length)")
    p.add_argument("--reference", choices=("auto", "adapter", "engine", "precomputed"), default="auto",
                   help="pref.reference for dpo/ipo (auto: adapter with --lora, else engine)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated module names")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: the decoder layers' Linears frozen in 4-bit (model.load_in_4bit; needs --lora)")
    p.add_argument("--grad-ckpt", action="store_true", help="only choices with gradient checkpointing")
    p.add_argument("--no-liger", action="store_true", help="plan without Liger's kernels (model.liger=false)")
    p.add_argument("--fused-loss", choices=("auto", "true", "false"), default="auto",
                   help="model.liger_fused_loss (auto, true: Liger's fused loss where Liger applies; false: off)")
    p.add_argument("--liger-chunk-mem-const", type=_chunk_setting, default="auto", metavar="auto|N",
                   help="model.liger_chunk_mem_const: the fused loss's chunks (auto: 2,048 rows; 1: Liger's own)")
    p.add_argument("--attn", choices=("sdpa", "eager", "flash_attention_2"), default="sdpa")
    p.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                   help="train.sequence_parallel: each row over N ranks (activations / N; global batch counts groups)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="DeepSpeed AutoEP (the config's expert_parallel, autoep_size N): each rank holds 1/N of the "
                        "experts whole; ZeRO-3 choices only")
    p.add_argument("--tiled-mlp", choices=("auto", "true", "false"), default="auto",
                   help="model.tiled_mlp (auto: on from 65,536 tokens of a row per rank)")
    p.add_argument("--tiled-loss", choices=("auto", "true", "false"), default="auto",
                   help="model.tiled_loss (auto: logits in tiles from 32,768 tokens of a row per rank, where "
                        "Liger's fused loss is not in use)")
    p.add_argument("--activation-offload", choices=("auto", "true", "pinned", "pageable", "false"), default="auto",
                   help="model.activation_offload: checkpointed layer inputs in host memory (auto: where they would "
                        "take a quarter of the GPU; pinned buffers where they fit half of --host-mem)")
    p.add_argument("--rope-factor", type=float, default=1.0,
                   help="model.rope_factor: the model's positions x this factor (rope scaling), to plan past them")
    p.add_argument("--doc-len", type=float, default=None,
                   help="packed rows: the documents' token-weighted mean length, as a run prints it (attention "
                        "runs within each document); default: full-length rows")
    p.add_argument("--zero3-leaves", choices=("auto", "true", "false"), default="auto",
                   help="train.zero3_leaves (auto: ZeRO-3 decoder layers as leaf modules where the run makes them so)")
    p.add_argument("--compile", choices=("auto", "off", "torch"), default="auto",
                   help="train.compile (auto: compiled for a run of 200+ steps; eager at ZeRO-3 under LoRA)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="the DeepSpeed config's optimizer: muon keeps one momentum buffer for the hidden matrices")
    p.add_argument("--optimizer-states", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: bf16 master weights, gradients and states (ZeRO 1-3; changes the numerics)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: torchao float8 matmuls in the decoder layers (train.precision=fp8; compile on)")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    p.add_argument("--task", choices=("causal_lm", "seq_cls"), default=None,
                   help="model.task (default: seq_cls for BERT, causal_lm otherwise)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="only this ZeRO stage")
    p.add_argument("--offload", choices=pl.OFFLOADS, default=None,
                   help="only this offload: none, optimizer (states to CPU), all (and parameters, stage 3)")
    p.add_argument("--micro-batch", type=int, default=None, help="only this micro-batch")
    p.add_argument("--top", type=int, default=12, help="rows to print (default 12)")
    p.add_argument("--json", action="store_true", help='print {"candidates": [...], "chosen": {...}}')
    p.add_argument("-o", "--output", default=None, help="write DIR/ds_config.json, DIR/train.yaml, DIR/plan.json")
    p.add_argument("--force", action="store_true", help="overwrite an earlier plan in DIR")
    p.set_defaults(func=_cmd)


def _cmd(args: Any) -> int:
    if args.task is None:
        kind = _model_type(args.model)
        args.task = "seq_cls" if kind == "bert" else "causal_lm"
    return run_plan(args)
