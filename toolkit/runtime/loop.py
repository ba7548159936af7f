"""The two training paths behind toolkit/train.py: HF Trainer and a raw deepspeed.initialize loop.

Shared by both: the resolved DeepSpeed dict, the model (built after the DeepSpeed config is alive,
so ZeRO-3 partitions it at construction), the batch order, the token-count loss normalization,
the warmup+cosine schedule (transformers' own function), metrics, memory snapshots and export.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from toolkit.config.ds_config import ConfigError, zero_stage
from toolkit.config.schema import packing
from toolkit.launch import dist
from toolkit.observe import breakdown, console
from toolkit.observe.memory import MemoryCallback, MemoryMonitor
from toolkit.observe.metrics import (
    MetricsLogger,
    TokenCounter,
    attention_width,
    closing_summary,
    count_params,
    flops_per_token,
    peak_flops_per_gpu,
)
from toolkit.observe.profiling import StepProfiler
from toolkit.plan.experts import ExpertsChoice
from toolkit.plan.speedups import leaves_blocked, tiled_loss_tile
from toolkit.runtime import attention, autotune, fp8, integrity, kernels, moe, resume, watchdog
from toolkit.runtime import compile as compiling
from toolkit.runtime.checkpoint import (
    DEFAULT_RUN_DIR,
    atomic_write,
    begin_save,
    claim_run_dir,
    end_save,
    export_model,
    mark_complete,
    save_deepspeed_checkpoint,
    write_run_files,
    write_status,
)
from toolkit.runtime.data import (
    Collator,
    EpochOrder,
    ListDataset,
    Rows,
    ShardedBatches,
    build_rows,
    document_note,
    even_rows,
    row_lengths,
    steps_per_epoch,
    to_device,
)
from toolkit.runtime.evaluate import evaluate, target_count
from toolkit.runtime.guards import NonFiniteError, NonFiniteGuard
from toolkit.runtime.integrity import CheckpointError
from toolkit.runtime.model import (
    build_model,
    build_tokenizer,
    check_first_loss,
    check_zero3_leaves,
    hidden_size,
    is_preset,
)
from toolkit.runtime.moe import autoep
from toolkit.runtime.preempt import Preemption
from toolkit.runtime.sequence import offload, tiling, ulysses

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


def run(p: RunSpec) -> int:
    cfg = p.cfg
    rank = dist.rank()
    compiled, compile_why = compiling.decide(cfg, p.ds, zero_stage(p.ds), p.total_steps, bool(p.fp8))
    tiled, tiled_why = tiling.decide(cfg.model.tiled_mlp, cfg.data.seq_len, cfg.train.sequence_parallel)
    if tiled and compiled and cfg.train.compile == "auto":  # correct compiled (tests), speed not measured
        compiled, compile_why = False, ("train.compile=auto with tiled MLPs: their compiled speed is not measured "
                                        "yet; train.compile=torch compiles")
    linear_note = compiling.plain_linear(p.ds) if compiled and zero_stage(p.ds) == 3 else None
    liger = kernels.choice_for(cfg, p.model_config.model_type, zero_stage(p.ds), compiled,
                               moe.fused_loss_setting(cfg, p.model_config, p.ds, p.world_size, compiled))
    try:
        experts_path = moe.choose_path(cfg, p.model_config, liger)
    except ConfigError as e:  # every rank decides alike, before anything started: one line, rc 1
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    if experts_path is not None:
        liger = moe.with_experts(liger, experts_path, p.model_config.model_type)
    attn = attention.for_run(cfg)
    offloading = _offload_plan(p)
    refused = _claim_run_dir(p)
    if refused is None:  # heartbeats from here on: a rank that dies, stops or hangs ends the job everywhere
        watchdog.start(p.run_dir, cfg.train.heartbeat_timeout_s, cfg.train.collective_timeout_s)
    if refused is None and p.resume_from:  # before anything is loaded or moved aside
        refused = resume.check_intact(p.resume_from, cfg.train.path)
        if refused:  # this run's own directory: its status says why the resume stopped
            write_status(p.run_dir, "failed", error=refused, phase="resume", step=p.resume_from.step)
    if refused:
        watchdog.close()
        if rank == 0:
            print(f"error: {refused}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        print(liger.describe(), flush=True)
        print(f"{packing(cfg)[1]}; {attn.note}", flush=True)
        if tiled or cfg.model.tiled_mlp != "auto":
            print(f"MLP tiled over the sequence: {'on' if tiled else 'off'} ({tiled_why})", flush=True)
        if offloading.on or cfg.model.activation_offload != "auto":
            print(offloading.describe(), flush=True)
        if not compiled:
            print(f"torch.compile: off ({compile_why})", flush=True)
        if linear_note:
            print(linear_note, flush=True)
        write_run_files(p.run_dir, cfg, p.ds, {"world_size": p.world_size, "precision": p.precision,
                                               "adapter_autocast": p.adapter_autocast, "path": cfg.train.path,
                                               "liger": liger.kwargs, "liger_note": liger.describe(),
                                               "packing": packing(cfg)[0], "attention": attn.implementation,
                                               "attention_note": attn.note, "tiled_mlp": tiled,
                                               "activation_offload": offloading.describe(),
                                               "compile": compiled, "compile_note": compile_why, "fp8": p.fp8,
                                               "experts_note": experts_path.describe() if experts_path else None})
        write_status(p.run_dir, "running")
        note = breakdown.copy_plan(cfg.train.plan, p.run_dir)
        if note:
            print(note, flush=True)
        if p.resume_from:
            note = resume.set_aside_newer(p.resume_from, cfg.train.path)
            if note:
                print(note, flush=True)
        if p.autotune:  # train.micro_batch_size=auto: the probes and the choice, reused by a later run
            atomic_write(p.run_dir / autotune.RECORD, json.dumps(p.autotune, indent=1) + "\n")
    dist.barrier()
    try:
        with console.rank_log(p.run_dir, rank):  # the traceback goes to logs/rank{N}.log
            try:
                rc = _run(p, liger, attn, (compiled, compile_why), experts_path, offloading)
            finally:
                ulysses.stop()  # sequence parallelism's process-wide state, for a next run in this process
    except CheckpointError as e:  # a save that could not happen: the same one line on every rank
        watchdog.failing(e)
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:
        watchdog.failing(e)  # ends this process instead when a peer is lost (watchdog.EXIT_LOST)
        raise
    watchdog.close()
    return rc


def _claim_run_dir(p: RunSpec) -> str | None:
    """Rank 0 decides (nothing is written yet), every rank learns the outcome: the refusal, or None."""
    outcome: list[str | None] = [None, None]  # [note, error]
    if dist.rank() == 0:
        t = p.cfg.train
        try:
            outcome[0] = claim_run_dir(p.run_dir, resume=bool(t.resume), overwrite=t.overwrite,
                                       default=Path(t.run_dir) == Path(DEFAULT_RUN_DIR))
        except ConfigError as e:
            outcome[1] = str(e)
    note, error = dist.broadcast_object(outcome)
    if note and dist.rank() == 0:
        print(note, flush=True)
    return error


def _offload_plan(p: RunSpec) -> offload.Plan:
    """model.activation_offload for this run: one micro-batch's tokens on a rank against its GPU and host."""
    cfg = p.cfg
    mc = p.model_config.get_text_config() if hasattr(p.model_config, "get_text_config") else p.model_config
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
    return offload.decide(cfg.model.activation_offload, grad_ckpt=cfg.model.gradient_checkpointing,
                          layers=int(getattr(mc, "num_hidden_layers", 0) or 0), hidden=hidden_size(mc),
                          tokens=micro * cfg.data.seq_len // cfg.train.sequence_parallel,
                          ranks_per_node=int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1))


def _run(p: RunSpec, liger: Any, attn: attention.AttentionPlan, compiled: tuple[bool, str],
         experts_path: ExpertsChoice | None, offloading: offload.Plan) -> int:
    cfg = p.cfg
    rank = dist.rank()
    # Python/NumPy/torch RNGs: dropout and PEFT's LoRA init draw from them. The HF Trainer seeds on
    # its own; the raw loop relied on this call, which was missing.
    dist.seed_all(cfg.train.seed)
    mem = MemoryMonitor(p.run_dir, rank, p.world_size, dist.local_rank(), every=cfg.memory.every,
                        spread_warn_gib=cfg.memory.spread_warn_gib, tensorboard=cfg.metrics.tensorboard)
    tokenizer = build_tokenizer(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else p.model_config.pad_token_id or 0
    rows, eval_rows = build_rows(cfg, p.model_config.vocab_size, pad_id, tokenizer)
    rows = even_rows(rows, cfg.train.micro_batch_size * cfg.train.grad_accum, p.data_world)
    if cfg.train.max_steps == 0:  # one epoch of the data actually loaded
        p.total_steps = steps_per_epoch(len(rows), cfg, p.data_world)

    autotune.inject_fault_for_tests(cfg.train.micro_batch_size)
    keep_alive = _deepspeed_config_alive(p)  # must exist before the model under ZeRO-3
    if experts_path is not None and experts_path.implementation:  # read by the experts modules at every forward
        p.model_config._experts_implementation = experts_path.implementation
    model = build_model(cfg, p.model_config, frozen_bf16=p.adapter_autocast, attn=attn.implementation)
    kernels.apply(model, liger)
    _tile_loss(p, model, liger)
    if zero_stage(p.ds) == 3:
        moe.set_leaves(model)  # blocks with one module per expert: leaves, or ZeRO-3 hangs when ranks route apart
    experts = moe.describe(model, p.ds, liger=bool(experts_path and experts_path.liger))
    aux_coef = moe.take_aux_loss(model, cfg.moe.aux_loss_coef)
    if experts and rank == 0:
        print(f"{experts}; load-balancing loss x {aux_coef:g} (moe.aux_loss_coef={cfg.moe.aux_loss_coef})", flush=True)
        if experts_path is not None:
            print(experts_path.describe(), flush=True)
    if autoep.enabled(p.ds):  # every rank: the registry fix must exist in each process before deepspeed.initialize
        found = moe.experts_of(model)
        line = autoep.prepare(p.ds, found.count if found else 0)
        if rank == 0:
            print(line, flush=True)
    if tiling.decide(cfg.model.tiled_mlp, cfg.data.seq_len, cfg.train.sequence_parallel)[0]:
        layers = compiling.decoder_layers(model)
        tiled = tiling.tile_mlps(layers, cfg.model.tiled_mlp_shards)
        if tiled < len(layers) and rank == 0:
            print(f"MLP tiling: {tiled} of {len(layers)} layers (Mixture-of-Experts blocks are not tiled)", flush=True)
    sp = ulysses.start(cfg.train.sequence_parallel, p.model_config, cfg.train.micro_batch_size) \
        if cfg.train.sequence_parallel > 1 else None
    _fp8_and_compile(p, model, *compiled)
    metrics = _metrics_logger(p, model)
    metrics.memory_reading = mem.reading  # every rank's memory for wandb / mlflow (metrics.report_to)
    mem.phase_boundary("model_loaded", 0)
    collator = Collator(pad_id=pad_id, task=cfg.model.task, drop_full_mask=True, boundaries=attn.boundaries,
                        whole_rows=attn.whole_rows, multiple_of=cfg.train.sequence_parallel)
    note = document_note(rows) if rank == 0 else None
    if note:
        print(note, flush=True)
    lengths = None if packing(cfg)[0] or not cfg.data.shuffle else row_lengths(rows)
    if lengths is not None and rank == 0:
        print("batches grouped by length (as HF's group_by_length): rows of similar length share a micro-batch",
              flush=True)
    order = EpochOrder(len(rows), cfg.train.seed, cfg.data.shuffle, lengths=lengths,
                       group=cfg.train.micro_batch_size * p.data_world)
    state = {"phase": "engine_ready", "step": 0, "preempt": Preemption(), "preempted": False, "sp": sp,
             "aux_coef": aux_coef, "offload": offloading,
             # the loss on this batch is recorded at every save and checked after every resume (whole on
             # every rank under sequence parallelism: no boundaries, so the attention is not sharded)
             "fixed_batch": resume.fixed_batch(rows, Collator(pad_id=pad_id, task=cfg.model.task,
                                                              boundaries=attn.boundaries and sp is None)),
             "profiler": StepProfiler(p.run_dir, rank, list(cfg.train.profile_steps)),
             "eval": _evaluator(p, eval_rows, collator, metrics, sp)}
    watchdog.follow(lambda: (state["phase"], state["step"]))
    metrics.engine_starting(f"ZeRO-{zero_stage(p.ds)}, {cfg.train.path} path, {p.world_size} ranks")
    try:
        with mem.oom_guard(lambda: (state["phase"], state["step"])):
            if cfg.train.path == "trainer":
                engine, step, stopped = _run_trainer(p, keep_alive, model, ListDataset(rows), collator, order,
                                                     metrics, mem, state)
            else:
                engine, step, stopped = _run_raw(p, model, ListDataset(rows), collator, order, metrics, mem,
                                                 state)
            state["profiler"].close(step)
            state["phase"] = "final"
            _finish(p, engine, tokenizer, rows, pad_id, stopped)
            if cfg.train.path == "raw":  # the Trainer path's final snapshot comes from MemoryCallback
                mem.phase_boundary("final", step)
            breakdown.finish(p.run_dir, rank, mem.run_peaks)
    except BaseException as e:
        # A peer that died shows up here as a collective error: the watchdog names it in status.json and
        # ends this process; otherwise rank 0 writes what it saw.
        watchdog.failing(e)
        write_status(p.run_dir, "failed", error=f"{type(e).__name__}: {e}"[:2000], phase=state["phase"],
                     step=state["step"])
        raise
    finally:
        with contextlib.suppress(Exception):  # a failed run keeps the window it recorded (no-op when closed)
            state["profiler"].close(state["step"])
        metrics.close()
        mem.close()
        state["preempt"].close()
    write_status(p.run_dir, "preempted" if state["preempted"] else "stopped" if stopped else "completed",
                 steps=step)
    if rank == 0:
        print(closing_summary(metrics.history, p.run_dir, step, p.total_steps, mem.rank_peaks,
                              cfg.metrics.tensorboard,
                              "SIGTERM: preempted, checkpoint written" if state["preempted"] else "train.stop_after"),
              flush=True)
    return 0


FP8_ZERO3_NOTE = ("note: here the decoder layers cannot be ZeRO-3 leaf modules (frozen input embeddings, or NVMe "
                  "parameter offload), so "
                  "DeepSpeed's hooks split each compiled layer into a graph per Linear and the float8 casts do not fuse "
                  "(llama-1b on one H200: 51.6k tokens/s against 80.2k at ZeRO-2; bench/results/fp8_compile.md)")


def _tile_loss(p: RunSpec, model: Any, liger: Any) -> None:
    """model.tiled_loss (toolkit/runtime/sequence/tiling.py tile_loss), after Liger: only where its fused loss is not
    in use. Every rank decides alike; rank 0 says what."""
    cfg = p.cfg
    on, why = tiling.loss_decide(cfg.model.tiled_loss, fused_loss=bool(liger.kwargs.get("fused_linear_cross_entropy")),
                                 tokens=cfg.data.seq_len // cfg.train.sequence_parallel,
                                 causal_lm=cfg.model.task == "causal_lm", moe=moe.is_moe(p.model_config))
    if not on:
        return
    tile = tiled_loss_tile(p.model_config.vocab_size)
    if not tiling.tile_loss(model, tile):
        if cfg.model.tiled_loss == "true":
            raise ValueError(f"model.tiled_loss=true: {type(model).__name__} has no decoder and output embeddings "
                             "to tile its loss over; set model.tiled_loss=auto or false")
        return  # auto: such a model keeps its plain loss
    if dist.rank() == 0:
        print(f"logits and loss tiled over the sequence: on ({why}; tiles of {tile:,} tokens)", flush=True)


def _fp8_and_compile(p: RunSpec, model: Any, compiled: bool, why: str) -> None:
    """After LoRA and Liger, before deepspeed.initialize (both paths): float8 Linears first, so the compiled
    graph is the float8 one, then each decoder layer compiled in place (toolkit/runtime/compile.py)."""
    layers = compiling.decoder_layers(model)
    lines = []
    if not p.fp8 and not dist.on_cpu() and not p.cfg.lora.enabled and p.cfg.model.task == "causal_lm" \
            and dist.rank() == 0:
        total, trainable = count_params(model)
        mc = p.model_config
        fpt = flops_per_token(total, trainable, len(layers), attention_width(mc), p.cfg.data.seq_len)
        lines.append(fp8.hint(layers, fpt, hidden_size(mc), dist.local_rank()) or "")
    if not (compiled or p.fp8):
        if dist.rank() == 0 and any(lines):
            print("\n".join(x for x in lines if x), flush=True)
        return
    may_leaf = zero_stage(p.ds) == 3 and leaves_blocked(lora=bool(p.cfg.lora.enabled), ds=p.ds) is None
    if p.fp8:
        lines.append(fp8.describe(fp8.convert(model, layers, p.fp8), p.fp8, len(layers)))
    if compiled:
        n, leaves = compiling.compile_layers(model, zero3_leaves=may_leaf)
        lines.append(compiling.describe(n, layers[0], why, leaves))
        if p.fp8 and zero_stage(p.ds) == 3 and not leaves:
            lines.append(FP8_ZERO3_NOTE)
    if dist.rank() == 0:
        print("\n".join(x for x in lines if x), flush=True)


def _evaluator(p: RunSpec, rows: Rows | None, collate: Collator, metrics: MetricsLogger, sp: Any = None) -> Any:
    """eval(engine, step, final): the held-out loss every train.eval_every steps and at the end; None
    without held-out data. Every rank calls it (ZeRO-3 forwards are collectives)."""
    if rows is None:
        return None
    every = p.cfg.train.eval_every

    def run(engine: Any, step: int, final: bool) -> None:
        if final or (every and step % every == 0 and step < p.total_steps):
            metrics.log_eval(step, evaluate(engine, rows, collate, p.cfg.train.micro_batch_size, p.cfg.model.task,
                                            sp))

    return run


def _metrics_logger(p: RunSpec, model: Any) -> MetricsLogger:
    """MFU needs FLOPs per token (counted on the built model: ZeRO-3 shards report their full size)
    and the GPU's peak, known for bf16/fp16 on the GPUs in metrics.GPU_PEAK_TFLOPS or from
    metrics.peak_tflops; otherwise the lines carry mfu=null."""
    total, trainable = count_params(model)
    mc = p.model_config
    layers = int(getattr(mc, "num_hidden_layers", None) or mc.n_layer)
    fpt = flops_per_token(total, trainable, layers, attention_width(mc), p.cfg.data.seq_len)
    name = None if dist.on_cpu() else torch.cuda.get_device_name(dist.local_rank())
    peak = peak_flops_per_gpu(name, p.precision, p.cfg.metrics.peak_tflops)
    return MetricsLogger(p.run_dir, p.total_steps, TokenCounter(), flops_per_token=fpt,
                         peak_flops=None if peak is None else peak * p.world_size,
                         tensorboard=p.cfg.metrics.tensorboard, report_to=tuple(p.cfg.metrics.report_to),
                         run_config=p.cfg.to_dict())


def _deepspeed_config_alive(p: RunSpec) -> Any:
    """Trainer path: TrainingArguments owns an HfTrainerDeepSpeedConfig; raw path: HfDeepSpeedConfig.

    transformers consults a weak reference to it when building a model, so the object must stay
    referenced until the engine exists; otherwise ZeRO-3 silently builds the full model per rank.
    """
    if p.cfg.train.path == "trainer":
        return _training_args(p)
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(p.ds)


def _training_args(p: RunSpec) -> Any:
    from transformers import TrainingArguments

    t = p.cfg.train
    save_steps = t.save_every or t.stop_after or 0
    return TrainingArguments(
        output_dir=str(p.run_dir / "checkpoints"),
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        adam_epsilon=t.eps, max_grad_norm=t.grad_clip,
        lr_scheduler_type="cosine", warmup_steps=t.warmup_steps, max_steps=p.total_steps,
        logging_steps=t.log_every, logging_first_step=True,  # the first-loss check reads step 1
        logging_nan_inf_filter=False,  # HF would log the last finite loss in place of a NaN
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        save_total_limit=t.keep_checkpoints or None,
        # under adapter autocast DeepSpeed's engine autocasts; Trainer bf16 would re-enable bf16 mode
        bf16=p.precision == "bf16" and not p.adapter_autocast, fp16=p.precision == "fp16",
        seed=t.seed, data_seed=t.seed, report_to=[], disable_tqdm=True, dataloader_drop_last=True,
        remove_unused_columns=False, deepspeed=p.ds, use_cpu=dist.on_cpu(), ddp_timeout=t.collective_timeout_s,
        # train.compile compiles the decoder layers before the Trainer exists (loop._fp8_and_compile); the
        # Trainer's own torch_compile would compile the whole engine again (and turn TF32 on globally)
        torch_compile=False,
        **{f"dataloader_{k}": v for k, v in loader_kwargs().items()},
        # accelerate copies batches with non_blocking=False by default: a wait per copy
        accelerator_config={"non_blocking": bool(loader_kwargs().get("pin_memory"))},
    )


def _first_step(p: RunSpec, step: int, loss: float, mem: MemoryMonitor) -> None:
    mem.phase_boundary("first_step", step)
    first_loss_check(p, loss)


def leaf_check(model: Any) -> None:
    """After the engine exists (DeepSpeed marks ZeRO-3 leaf modules during initialize), before step 1."""
    msg = check_zero3_leaves(model)
    if msg:
        raise RuntimeError(msg)


def autoep_check(p: RunSpec, model: Any) -> None:
    """After the engine exists: the MoE layers DeepSpeed's AutoEP replaced (none is an error: its preset did not
    match the model, and the run would train without expert parallelism)."""
    if not autoep.enabled(p.ds):
        return
    n = autoep.replaced(model)
    if n == 0:
        raise RuntimeError(autoep.nothing_replaced(p.ds, model))
    if dist.rank() == 0:
        print(f"AutoEP: {n} MoE layers replaced by DeepSpeed's AutoEPMoELayer", flush=True)


def first_loss_check(p: RunSpec, loss: float) -> None:
    msg = check_first_loss(loss, p.model_config.vocab_size, p.cfg.model.task, not is_preset(p.cfg.model.name))
    if msg:
        raise RuntimeError(msg)


# ----------------------------------------------------------------------------- HF Trainer path


def _run_trainer(p: RunSpec, args: Any, model: Any, dataset: ListDataset, collator: Collator,
                 order: EpochOrder, metrics: MetricsLogger, mem: MemoryMonitor,
                 state: dict[str, Any]) -> tuple[Any, int, bool]:
    from transformers import PrinterCallback, Trainer, TrainerCallback

    t = p.cfg.train
    counter = metrics.counter
    sp = state["sp"]
    global_batch = t.micro_batch_size * t.grad_accum * p.world_size // t.sequence_parallel
    universal: str | None = None
    aux_coef = state["aux_coef"]
    offloading = state["offload"]
    sampler: Any = ulysses.GroupOrder(order, t.micro_batch_size, sp.size) if sp else order
    per_epoch = steps_per_epoch(len(dataset), p.cfg, p.data_world)
    if sp:  # each rank trains on its slice of its group's micro-batch (sequence/ulysses.py)
        collator = ulysses.ShardingCollator(collator, sp)

    class ToolkitTrainer(Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return sampler  # the raw loop deals the same order to the same ranks

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            if sp:  # a group's micro-batch is counted once, whole (its slices cannot tell padding from tokens)
                tokens = inputs.pop(ulysses.TOKENS_KEY)
                if sp.rank == 0:
                    counter.add_counted(tokens, inputs["input_ids"].numel() * sp.size, inputs["input_ids"].shape[0])
            else:
                counter.add(inputs)  # on the device, no sync: collation runs in loader workers
            with offload.context(offloading):  # the Trainer's step is one micro-batch's forward and backward
                return super().training_step(model, inputs, num_items_in_batch)

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if not (aux_coef and model.training):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            # the Trainer multiplies the model's loss by the world size and never divides by the accumulation
            # steps: the load-balancing loss is added after that, at its own scale (moe.aux_term)
            loss, out = super().compute_loss(model, {**inputs, "output_router_logits": True}, True, num_items_in_batch)
            loss = loss + moe.aux_term(out, aux_coef, self.args.gradient_accumulation_steps)
            return (loss, out) if return_outputs else loss

        # Under DeepSpeed, accelerate's clip_grad_norm_ returns the engine's norm as a float (.item()),
        # and the Trainer reads it that way again: a GPU->host wait every optimizer step, which keeps
        # the host from queueing the next step's kernels (it cost Qwen2-0.5B ZeRO-2 7% on 2 H200s).
        # DeepSpeed has clipped already; the norm stays a device tensor, read on log steps only (the
        # Trainer's log converts tensors). Both methods exist in transformers 5.x; where they do not,
        # these overrides are never called and the Trainer behaves as before.
        def _clip_grad_norm(self, model: Any) -> Any:
            if self.is_deepspeed_enabled:
                return self.model_wrapped.get_global_grad_norm()
            return super()._clip_grad_norm(model)

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            if self.is_deepspeed_enabled:  # the engine's norm, clipped or not (max_grad_norm=0 skips the above)
                return self.model_wrapped.get_global_grad_norm()
            return super()._get_grad_norm(model, grad_norm=grad_norm)

    class Hooks(TrainerCallback):
        def on_train_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            leaf_check(trainer.model)  # the Trainer has built the engine by now
            autoep_check(p, trainer.model)
            integrity.install(trainer.model_wrapped)  # shards digested as they are written
            if p.resume_from:  # the Trainer has loaded the checkpoint by now
                resume.verify(trainer.model_wrapped, state["fixed_batch"], p.resume_from, p.run_dir, p.precision,
                              p.world_size, t.grad_accum, universal)
            state["phase"] = "train"
            metrics.start(st.global_step)
            state["profiler"].step_done(st.global_step)  # a window that includes the first step opens here

        def on_epoch_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # The Trainer calls set_epoch on its loader after wrapping it to skip a resumed epoch's consumed batches
            # (transformers 5.24 _run_epoch, accelerate's SkipBatchSampler): that wrapper does not pass it on, so a
            # resumed epoch past the first would replay epoch 0's order. Set here, before the epoch's iterator exists.
            sampler.set_epoch(st.global_step // per_epoch)

        def on_step_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            watchdog.step_begin(st.global_step + 1)  # the hang deadline covers the step, not the save after it

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> Any:
            watchdog.step_end()
            state["step"] = st.global_step
            state["profiler"].step_done(st.global_step)
            if not state.get("breakdown"):  # after this process's first optimizer step: states exist
                state["breakdown"] = breakdown.record(p.run_dir, dist.rank(), trainer.model_wrapped, st.global_step)
            if state["eval"]:
                state["eval"](trainer.model_wrapped, st.global_step, False)
            if t.stop_after and st.global_step >= t.stop_after:
                control.should_save = True
                control.should_training_stop = True
            elif (st.global_step % t.log_every == 0 and st.global_step < st.max_steps
                  and state["preempt"].agreed()):  # SIGTERM: stop here, with a checkpoint
                control.should_save = True
                control.should_training_stop = True
                state["preempted"] = True
            if control.should_save:  # the Trainer saves right after this hook, into checkpoint-<step>
                state["save"] = begin_save(trainer.model_wrapped, Path(args.output_dir) / f"checkpoint-{st.global_step}",
                                           "checkpoint-")
            return control

        def on_train_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # the end of the schedule, not a stop (train.stop_after, SIGTERM): the final held-out loss
            if state["eval"] and st.global_step >= st.max_steps and not state["preempted"]:
                state["eval"](trainer.model_wrapped, st.global_step, True)

        def on_save(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # Called on every rank once the Trainer's save returned; DeepSpeed's save ends with a
            # barrier, so every rank's shard is on disk. Resume only trusts marked checkpoints.
            ckpt = Path(args.output_dir) / f"checkpoint-{st.global_step}"
            # every rank ran on_step_end's begin_save (the Trainer saves only where should_save was set there)
            digests = end_save(state.pop("save"), ckpt) if "save" in state else {}
            record = resume.save_record(trainer.model_wrapped, state["fixed_batch"], p.world_size, global_batch,
                                        t.sequence_parallel)
            if dist.rank() == 0:
                mark_complete(ckpt, st.global_step, record | digests)

        def on_log(self, args: Any, st: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs:
                return
            metrics.log(st.global_step, float(logs["loss"]), float(logs.get("learning_rate", 0.0)),
                        logs.get("grad_norm"))
            norm = logs.get("grad_norm")
            if not math.isfinite(float(logs["loss"])) or (
                    p.precision != "fp16" and norm is not None and not math.isfinite(float(norm))):
                # the loss and the norm are global here, so every rank stops at this log step
                raise NonFiniteError(f"rank {dist.rank()}: loss or gradient norm is NaN/Inf in the "
                                     f"{t.log_every} step(s) up to step {st.global_step} (Trainer path; "
                                     "train.log_every=1 names the exact step); lower train.lr or check the data")
            if st.global_step == 1:  # memory's first_step snapshot comes from MemoryCallback
                first_loss_check(p, float(logs["loss"]))

    trainer = ToolkitTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             callbacks=[Hooks(), MemoryCallback(mem)])
    # Our progress bar, metrics.jsonl and TensorBoard files replace its dict prints; report_to=[] stays,
    # so both paths write the same tags through MetricsLogger instead of HF's TensorBoardCallback.
    trainer.remove_callback(PrinterCallback)
    if sp and not trainer.model_accepts_loss_kwargs:
        # without num_items_in_batch each rank's slice would take its own mean (a slice of prompt only: NaN)
        raise ValueError(f"train.sequence_parallel on the HF Trainer path needs a model whose loss takes "
                         f"num_items_in_batch ({type(trainer.model).__name__} does not); use train.path=raw")
    if p.cfg.model.task == "seq_cls":
        # The Trainer sees **kwargs on forward and assumes the model normalizes by num_items_in_batch,
        # then multiplies the (plain mean) classification loss by the world size: loss and gradients
        # come out world_size x too large. Declaring the truth restores mean / grad_accum.
        trainer.model_accepts_loss_kwargs = False
    # run_plan found the newest *complete* checkpoint (HF's get_last_checkpoint takes partial ones too);
    # on another rank count it becomes a universal checkpoint, which the DeepSpeed dict says to load.
    universal = resume.prepare(p.reshard, t.collective_timeout_s)
    trainer.train(resume_from_checkpoint=str(p.resume_from.dir) if p.resume_from else None)
    metrics.close()  # the bar ends before export and the summary print
    step = trainer.state.global_step
    stopped = bool(t.stop_after and step >= t.stop_after and step < p.total_steps) or state["preempted"]
    return trainer.model_wrapped, step, stopped


# ----------------------------------------------------------------------------- raw loop


def _lr_schedule(p: RunSpec) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    total, warmup = p.total_steps, p.cfg.train.warmup_steps
    return lambda optimizer: get_cosine_schedule_with_warmup(optimizer, warmup, total)


def _micro_batches(loader: torch.utils.data.DataLoader, sampler: ShardedBatches, epoch: int) -> Iterator[Any]:
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _run_raw(p: RunSpec, model: Any, dataset: ListDataset, collator: Collator, order: EpochOrder,
             metrics: MetricsLogger, mem: MemoryMonitor, state: dict[str, Any]) -> tuple[Any, int, bool]:
    import deepspeed

    t = p.cfg.train
    world, rank = p.world_size, dist.rank()
    sp = state["sp"]
    # under sequence parallelism the ranks of a group draw the same batches and each keeps its slice
    data_rank, data_world = (sp.dp_rank, sp.dp_world) if sp else (rank, world)
    loss_mult = ulysses.loss_multiplier(sp, p.ds) if sp else world
    aux_coef = state["aux_coef"]
    offloading = state["offload"]
    aux_kwargs = {"output_router_logits": True} if aux_coef else {}
    experts = moe.experts_of(model) if aux_coef else None
    load = moe.ExpertLoad(experts.top_k) if experts else None
    params = [q for q in model.parameters() if q.requires_grad]
    universal = resume.prepare(p.reshard, t.collective_timeout_s)  # another rank count: convert first
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=params, config=p.ds,
                                                   lr_scheduler=_lr_schedule(p), mpu=sp.mpu if sp else None)
    leaf_check(engine.module)
    autoep_check(p, engine.module)
    ckpt_dir = p.run_dir / "checkpoints"
    global_batch = t.micro_batch_size * t.grad_accum * data_world
    step = 0
    if p.resume_from:
        ck = p.resume_from
        path, client = engine.load_checkpoint(str(ck.tag_dir.parent), tag=universal or ck.tag_dir.name)
        if path is None:
            raise FileNotFoundError(f"train.resume={t.resume}: DeepSpeed could not load {ck.tag_dir}")
        step = int(client["step"])
        resume.verify(engine, state["fixed_batch"], ck, p.run_dir, p.precision, world, t.grad_accum, universal)
    mem.phase_boundary("engine_ready", step)

    sampler = ShardedBatches(order, t.micro_batch_size, data_rank, data_world)
    per_epoch = len(sampler)  # micro-batches per rank per epoch, a multiple of grad_accum
    consumed = step * t.grad_accum
    sampler.skip = consumed % per_epoch
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, **loader_kwargs())
    stream = _micro_batches(loader, sampler, consumed // per_epoch)
    causal = p.cfg.model.task == "causal_lm"
    device = dist.device()
    counter = metrics.counter
    metrics.start(step)
    state["phase"] = "train"
    total = p.total_steps
    last = min(total, t.stop_after) if t.stop_after else total
    guard = NonFiniteGuard(device, rank, p.precision == "fp16", t.max_skipped_steps)
    engine.train()
    state["profiler"].step_done(step)  # a window that includes step + 1 (1, or the resumed step + 1) opens here
    # Nothing in this loop waits for the GPU except on log steps: the label count is reduced on the
    # device, the loss accumulates there, and host values (loss, grad norm) are read only to log.
    while step < last:
        watchdog.step_begin(step + 1)  # the hang deadline covers the step, not the save or eval after it
        batches = [next(stream) for _ in range(t.grad_accum)]
        samples = [i for _ in batches for i in sampler.drawn.popleft()]
        for b in batches if not sp or sp.rank == 0 else []:  # a group's batches are counted once
            counter.add(b)  # host tensors: free
        if sp:
            batches = [sp.shard(b) for b in batches]
        n_items = _label_count(batches, device) if causal else None
        acc = torch.zeros((), device=device)
        aux_acc = torch.zeros((), device=device)
        for b in batches:
            b = to_device(b, device)
            if causal:
                # Token-level mean over the whole accumulation window and all ranks, the same
                # normalization the HF Trainer uses (model returns sum/n_items; DeepSpeed then
                # averages over ranks, hence x world; no extra 1/grad_accum). Under sequence parallelism
                # see ulysses.loss_multiplier.
                with offload.context(offloading):  # forward and backward of one micro-batch
                    out = engine(**b, num_items_in_batch=n_items, **aux_kwargs)
                    aux = moe.aux_term(out, aux_coef, t.grad_accum)
                    loss = out.loss * loss_mult + aux
                    engine.backward(loss, scale_wrt_gas=False)
                acc += loss.detach()
                if isinstance(aux, torch.Tensor):
                    aux_acc += aux.detach() / aux_coef
                if load is not None:
                    load.add(getattr(out, "router_logits", None))
            else:
                with offload.context(offloading):
                    loss = engine(**b).loss
                    engine.backward(loss)
                acc += loss.detach() / t.grad_accum
            engine.step()
        step += 1
        state["step"] = step
        grad_norm = engine.get_global_grad_norm()  # often a device tensor: read on log steps only
        guard.observe(step, acc, grad_norm, samples, engine.skipped_steps)
        logged = step % t.log_every == 0 or step == last or step == 1
        if logged:
            extra = None
            if aux_coef:  # the load-balancing loss alone, the mean over micro-batches and ranks (a collective)
                extra = {"moe_aux_loss": float(dist.all_reduce_tensor(aux_acc)) / world}
                if load is not None:  # per MoE layer: the busiest expert's tokens / the mean, over the window
                    extra["expert_load"] = load.take()
            rec = metrics.log(step, float(acc), scheduler.get_last_lr()[0],
                              None if grad_norm is None else float(grad_norm), loss_scale=1 / loss_mult,
                              extra=extra)
            guard.check()
            if step == 1:
                _first_step(p, step, rec["loss"], mem)
        if not state.get("breakdown"):  # after this process's first optimizer step: states exist
            state["breakdown"] = breakdown.record(p.run_dir, rank, engine, step)
        if step > 1:
            mem.maybe_step(step)
        watchdog.step_end()
        if state["eval"]:
            state["eval"](engine, step, False)
        saving = bool((t.save_every and step % t.save_every == 0) or (t.stop_after and step == last and step < total))
        preempted = logged and step < last and state["preempt"].agreed()  # SIGTERM: stop here, with a checkpoint
        if saving or preempted:
            state["phase"] = "save"  # what status.json says if the save fails
            save_deepspeed_checkpoint(engine, ckpt_dir, step, t.keep_checkpoints,
                                      lambda: resume.save_record(engine, state["fixed_batch"], world, global_batch,
                                                                 t.sequence_parallel))
            state["phase"] = "train"
        if preempted:
            state["preempted"] = True
            break
        state["profiler"].step_done(step)
    if state["eval"] and step >= total:
        state["eval"](engine, step, True)
    metrics.close()  # the bar ends before export and the summary print
    return engine, step, step < total


def loader_kwargs() -> dict[str, Any]:
    """Batches prepared ahead of the step: a collating worker and pinned memory on GPUs. On CPU the
    ranks already share the cores, and a worker per rank would only compete with them."""
    if dist.on_cpu():
        return {}
    return {"num_workers": 2, "pin_memory": True, "prefetch_factor": 4, "persistent_workers": True}


def _label_count(batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Predicted tokens in the accumulation window on all ranks (labels shift by one), summed on the
    device: the forward waits for it on the stream, the host does not."""
    local = sum(target_count(b) for b in batches)
    return dist.all_reduce_tensor(torch.as_tensor(local, dtype=torch.int64).to(device, non_blocking=True))


# ----------------------------------------------------------------------------- end of run


def _finish(p: RunSpec, engine: Any, tokenizer: Any, rows: Rows, pad_id: int, stopped: bool) -> None:
    cfg = p.cfg
    if cfg.train.save_probe:
        _save_probe(p, engine, rows, pad_id)
    if stopped:
        return
    if cfg.eval.generate:
        from toolkit.runtime.generate import run_eval_generation

        # Every rank calls it: under ZeRO-3 each forward is a collective, like the export below.
        with compiling.eager():  # compiled layers decode eagerly (toolkit/runtime/compile.py)
            run_eval_generation(p, engine, tokenizer, rows)
    if not cfg.train.export:
        return
    out = p.run_dir / ("adapter" if cfg.lora.enabled else "export")
    t0 = time.perf_counter()
    export_model(engine, out, tokenizer)
    if dist.rank() == 0:
        print(f"exported {out} in {time.perf_counter() - t0:.1f}s", flush=True)


@torch.no_grad()
def _save_probe(p: RunSpec, engine: Any, rows: Rows, pad_id: int) -> None:
    """Logits of the trained engine on two fixed samples, to compare with the exported weights."""
    collate = Collator(pad_id=pad_id, task=p.cfg.model.task)
    inputs = {k: v for k, v in collate(rows[:2]).items() if k != "labels"}  # packed rows: position_ids, no mask
    engine.eval()
    out = engine(**{k: v.to(dist.device()) for k, v in inputs.items()})
    if dist.rank() == 0:
        torch.save({**inputs, "logits": out.logits.float().cpu()}, p.run_dir / "probe.pt")
    engine.train()

