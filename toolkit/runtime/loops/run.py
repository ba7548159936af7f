"""A run from its spec to its closing summary, for both paths: the run dir claimed, the resolved record printed and
written, the data, the model as the record says (loops/build.py), the HF Trainer path (loops/trainer.py) or the raw
loop (loops/raw.py), then generation, export and the summary.

Shared by both paths: the resolved DeepSpeed dict, the model (built after the DeepSpeed config is alive, so ZeRO-3
partitions it at construction), the batch order, the token-count loss normalization, the warmup+cosine schedule
(transformers' own function), metrics, memory snapshots and export. Nothing here decides a setting: the record
(toolkit/runtime/resolved.py) did.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist
from toolkit.observe import breakdown, console
from toolkit.observe.memory import MemoryMonitor
from toolkit.observe.metrics import MetricsLogger, closing_summary
from toolkit.observe.profiling import StepProfiler
from toolkit.runtime import attention, resolved
from toolkit.runtime.data.batches import (
    Collator,
    EpochOrder,
    ListDataset,
    Rows,
    build_rows,
    document_note,
    even_rows,
    row_lengths,
    steps_per_epoch,
)
from toolkit.runtime.faults import export_check, resume, watchdog
from toolkit.runtime.faults.checkpoint import (
    DEFAULT_RUN_DIR,
    atomic_write,
    claim_run_dir,
    export_model,
    write_run_files,
    write_status,
)
from toolkit.runtime.faults.integrity import CheckpointError
from toolkit.runtime.loops.build import build
from toolkit.runtime.loops.raw import RawLoop
from toolkit.runtime.loops.shared import evaluator, metrics_logger
from toolkit.runtime.loops.state import RunState
from toolkit.runtime.loops.trainer import run_trainer, training_args
from toolkit.runtime.model import build_tokenizer
from toolkit.runtime.objectives.batch import PairCollator
from toolkit.runtime.rl.rewards import RewardError
from toolkit.runtime.sequence import ulysses
from toolkit.runtime.speed import autotune
from toolkit.runtime.speed import compile as compiling

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


def run(p: RunSpec) -> int:
    cfg, r = p.cfg, p.resolved
    rank = dist.rank()
    gqa = attention.install(r.attention, r.machine.cuda)
    refused, run_id = _claim_run_dir(p)
    if refused is None:  # heartbeats from here on: a rank that dies, stops or hangs ends the job everywhere
        watchdog.start(p.run_dir, cfg.train.heartbeat_timeout_s, cfg.train.collective_timeout_s, run_id)
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
        _announce(p, gqa)
    dist.barrier()
    try:
        with console.rank_log(p.run_dir, rank):  # the traceback goes to logs/rank{N}.log
            try:
                rc = _train(p)
            finally:
                ulysses.stop()  # sequence parallelism's process-wide state, for a next run in this process
    except (CheckpointError, ConfigError, RewardError) as e:  # a save that could not happen, an input found bad once
        # it was read, a reward function that failed: the same one line on every rank
        watchdog.failing(e)
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:
        watchdog.failing(e)  # ends this process instead when a peer is lost (watchdog.EXIT_LOST)
        raise
    watchdog.close()
    return rc


def _announce(p: RunSpec, gqa: str | None) -> None:
    """Rank 0: the record as one block (and what changed since the run this one resumes), then the run's files."""
    cfg, r = p.cfg, p.resolved
    print("\n".join(r.lines(gqa)), flush=True)
    if p.resume_from:
        changed = resolved.saved_changes(p.run_dir, r)
        if changed:
            print(f"resume: these settings differ from the run being resumed ({resolved.RECORD}):\n  "
                  + "\n  ".join(changed), flush=True)
    write_run_files(p.run_dir, cfg, p.ds, r.versions(gqa) | {"path": cfg.train.path})
    atomic_write(p.run_dir / resolved.RECORD, json.dumps(r.to_dict(), indent=1) + "\n")
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


def _claim_run_dir(p: RunSpec) -> tuple[str | None, str]:
    """Rank 0 decides (nothing is written yet), every rank learns the outcome: (the refusal or None, this run's id for
    the watchdog's keys, new for every run, also the second run of one process)."""
    outcome: list[str | None] = [None, None, uuid.uuid4().hex[:12]]  # [note, error, run id]
    if dist.rank() == 0:
        t = p.cfg.train
        try:
            outcome[0] = claim_run_dir(p.run_dir, resume=bool(t.resume), overwrite=t.overwrite,
                                       default=Path(t.run_dir) == Path(DEFAULT_RUN_DIR))
        except ConfigError as e:
            outcome[1] = str(e)
    note, error, run_id = dist.broadcast_object(outcome)
    if note and dist.rank() == 0:
        print(note, flush=True)
    return error, run_id


def _train(p: RunSpec) -> int:
    cfg, r = p.cfg, p.resolved
    rank = dist.rank()
    # Python/NumPy/torch RNGs: dropout and PEFT's LoRA init draw from them. The HF Trainer seeds on
    # its own; the raw loop relied on this call, which was missing.
    dist.seed_all(cfg.train.seed)
    mem = MemoryMonitor(p.run_dir, rank, p.world_size, dist.local_rank(), every=cfg.memory.every,
                        spread_warn_gib=cfg.memory.spread_warn_gib, tensorboard=cfg.metrics.tensorboard)
    tokenizer = build_tokenizer(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else p.model_config.pad_token_id or 0
    if cfg.train.objective == "sft":
        rows, eval_rows = build_rows(cfg, p.model_config.vocab_size, pad_id, tokenizer)
    elif cfg.train.objective == "grpo":
        rows, eval_rows = _prompt_rows(p, tokenizer), None
    else:
        rows, eval_rows = _pair_rows(p, tokenizer)
    rows = even_rows(rows, cfg.train.micro_batch_size * cfg.train.grad_accum, p.data_world)
    if cfg.train.max_steps == 0:  # one epoch of the data actually loaded
        p.total_steps = steps_per_epoch(len(rows), cfg, p.data_world)

    autotune.inject_fault_for_tests(cfg.train.micro_batch_size)
    keep_alive = _deepspeed_config_alive(p)  # must exist before the model under ZeRO-3
    try:
        built = build(p)
    except ConfigError as e:  # a checkpoint that does not match its model (faults/load_report.py), ...: said, not running
        write_status(p.run_dir, "failed", error=str(e)[:2000], phase="build", step=0)
        raise
    model, sp = built.model, built.sp
    pref = _preference(p, keep_alive, model, rows, eval_rows, pad_id, tokenizer)
    metrics = metrics_logger(p, model)
    if hasattr(pref, "counter"):  # an RL step counts the sequences it generates and trains on
        pref.counter = metrics.counter
    metrics.memory_reading = mem.reading  # every rank's memory for wandb / mlflow (metrics.report_to)
    generate = _generation(p, tokenizer, rows, metrics)
    mem.phase_boundary("model_loaded", 0)
    attn = r.attention
    collator = Collator(pad_id=pad_id, task=cfg.model.task, drop_full_mask=True, boundaries=attn.boundaries,
                        whole_rows=attn.whole_rows, multiple_of=cfg.train.sequence_parallel)
    note = document_note(rows) if rank == 0 else None
    if note:
        print(note, flush=True)
    lengths = None if r.packing or not cfg.data.shuffle else row_lengths(rows)
    if lengths is not None and rank == 0:
        print("batches grouped by length (as HF's group_by_length): rows of similar length share a micro-batch",
              flush=True)
    order = EpochOrder(len(rows), cfg.train.seed, cfg.data.shuffle, lengths=lengths,
                       group=cfg.train.micro_batch_size * p.data_world)
    state = RunState(
        profiler=StepProfiler(p.run_dir, rank, list(cfg.train.profile_steps)),
        # whole on every rank under sequence parallelism: no boundaries, so the attention is not sharded
        fixed_batch=_fixed_batch(cfg, rows, pad_id, attn.boundaries and sp is None),
        evaluate=evaluator(p, eval_rows, collator, metrics, sp, generate, pref), sp=sp, aux_coef=built.aux_coef,
        pref=pref)
    watchdog.follow(lambda: (state.phase, state.step))
    metrics.engine_starting(f"ZeRO-{r.stage}, {cfg.train.path} path, {p.world_size} ranks")
    step, stopped = 0, False
    try:
        with mem.oom_guard(lambda: (state.phase, state.step)):
            batches = collator if pref is None else pref.collate
            if cfg.train.path == "trainer":
                engine, step, stopped = run_trainer(p, keep_alive, model, ListDataset(rows), batches, order,
                                                    metrics, mem, state)
            else:
                engine, step, stopped = RawLoop(p, model, ListDataset(rows), batches, order, metrics, mem,
                                                state).train()
            state.profiler.close(step)
            state.phase = "final"
            _finish(p, engine, tokenizer, rows, pad_id, stopped, generate and (lambda e: generate(e, step, True)),
                    state.fixed_batch)
            if cfg.train.path == "raw":  # the Trainer path's final snapshot comes from MemoryCallback
                mem.phase_boundary("final", step)
            breakdown.finish(p.run_dir, rank, mem.run_peaks)
    except BaseException as e:
        # A peer that died shows up here as a collective error: the watchdog names it in status.json and
        # ends this process; otherwise rank 0 writes what it saw.
        watchdog.failing(e)
        write_status(p.run_dir, "failed", error=f"{type(e).__name__}: {e}"[:2000], phase=state.phase,
                     step=state.step)
        raise
    finally:
        with contextlib.suppress(Exception):  # a failed run keeps the window it recorded (no-op when closed)
            state.profiler.close(state.step)
        metrics.close()
        mem.close()
        state.preempt.close()
    write_status(p.run_dir, "preempted" if state.preempted else "stopped" if stopped else "completed",
                 steps=step)
    if rank == 0:
        print(closing_summary(metrics.history, p.run_dir, step, p.total_steps, mem.rank_peaks,
                              cfg.metrics.tensorboard,
                              "SIGTERM: preempted, checkpoint written" if state.preempted else "train.stop_after"),
              flush=True)
    return 0


def _fixed_batch(cfg: Any, rows: Rows, pad_id: int, boundaries: bool) -> dict[str, Any]:
    """The batch a checkpoint's load is proved on (faults/resume.py). A preference run's rows are its pairs' chosen
    sequences; a reward model scores them (no labels: the proof is its scores)."""
    task = cfg.model.task if cfg.train.objective == "sft" else "causal_lm"
    if cfg.train.objective == "grpo":  # prompts: the proof scores their tokens
        rows = [{"input_ids": r["prompt_ids"], "labels": r["prompt_ids"]} for r in rows[:2]]
    batch = resume.fixed_batch(rows, Collator(pad_id=pad_id, task=task, boundaries=boundaries))
    if cfg.train.objective == "reward":
        batch.pop("labels")
    return batch


def _deepspeed_config_alive(p: RunSpec) -> Any:
    """Trainer path: TrainingArguments owns an HfTrainerDeepSpeedConfig; raw path: HfDeepSpeedConfig.

    transformers consults a weak reference to it when building a model, so the object must stay
    referenced until the engine exists; otherwise ZeRO-3 silently builds the full model per rank.
    """
    if p.cfg.train.path == "trainer":
        return training_args(p)
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(p.ds)


def _pair_rows(p: RunSpec, tokenizer: Any) -> tuple[Rows, Rows | None]:
    """A preference run's pairs (objectives/pairs.py), from data.source or learnable synthetic ones, and its
    held-out pairs (data.eval_source, or a data.eval_fraction drawn as for SFT rows) or None."""
    from toolkit.runtime.data.batches import split_eval
    from toolkit.runtime.objectives import pairs

    cfg = p.cfg
    length = cfg.pref.max_length or cfg.data.seq_len

    from toolkit.runtime.data.corpus import default_cache_dir

    def read(source: str, what: str) -> Rows:
        got, note = pairs.load_cached(source, tokenizer, length, what, cfg.data.cache_dir or default_cache_dir(),
                                      kto=cfg.train.objective == "kto")
        if dist.rank() == 0:
            print(note, flush=True)
        return Rows(got)

    if cfg.data.source == "synthetic":
        make = pairs.synthetic_kto if cfg.train.objective == "kto" else pairs.synthetic
        rows = Rows(make(cfg.data.num_samples, length, p.model_config.vocab_size, cfg.train.seed))
    else:
        rows = read(cfg.data.source, "data.source")
    if cfg.data.eval_source:
        return rows, read(cfg.data.eval_source, "data.eval_source")
    if cfg.data.eval_fraction:
        return split_eval(rows, cfg.data.eval_fraction, cfg.train.seed)
    return rows, None


def _prompt_rows(p: RunSpec, tokenizer: Any) -> Rows:
    """An RL run's prompts (rl/prompts.py), tokenized; prompts cut to rl.max_prompt_length are counted."""
    from toolkit.runtime.rl import prompts

    got, cut = prompts.load(p.cfg.data.source, tokenizer, p.cfg.rl.max_prompt_length)
    if dist.rank() == 0:
        note = f", {cut} cut to their last {p.cfg.rl.max_prompt_length} tokens (rl.max_prompt_length)" if cut else ""
        print(f"data.source: {len(got)} prompts from {p.cfg.data.source}{note}", flush=True)
    return Rows(got)


def _rl_step(p: RunSpec, keep_alive: Any, model: Any, pad_id: int, tokenizer: Any) -> Any:
    """train.objective=grpo: the step that rolls out and trains each window, with the reference engine where
    rl.beta > 0 on a full fine-tune; dropout off in the policy, so the log-probs trained on are those of the policy
    that sampled (generation runs in eval mode; TRL's GRPO leaves dropout on by default)."""
    from toolkit.config.ds_config import zero_stage
    from toolkit.runtime.generation.evaluate import ids_of
    from toolkit.runtime.objectives.reference import build_reference, disable_dropout
    from toolkit.runtime.rl import rewards
    from toolkit.runtime.rl.step import GRPOStep

    cfg, r = p.cfg, p.resolved
    disable_dropout(model)
    reference = build_reference(cfg, p.model_config, p.ds, keep_alive, r) if r.reference == "engine" else None
    _, eos_id = ids_of(p, tokenizer)
    return GRPOStep(cfg, r.reference, model, reference, model_config=p.model_config, zero3=zero_stage(p.ds) == 3,
                    pad_id=pad_id, eos_id=eos_id, tokenizer=tokenizer,
                    rewards=rewards.load(cfg.rl.rewards, list(cfg.rl.reward_weights), cfg.rl.max_completion_length),
                    run_dir=p.run_dir, boundaries=r.attention.boundaries)


def _preference(p: RunSpec, keep_alive: Any, model: Any, rows: Rows, eval_rows: Rows | None, pad_id: int,
                tokenizer: Any = None) -> Any:
    """train.objective other than sft: the step that runs its windows, with the reference engine where it has one
    (and where the reference is precomputed, where its values are kept); dropout off in the policy (as TRL does by
    default)."""
    cfg, r = p.cfg, p.resolved
    if cfg.train.objective == "sft":
        return None
    if cfg.train.objective == "grpo":
        return _rl_step(p, keep_alive, model, pad_id, tokenizer)
    from toolkit.runtime.objectives.reference import build_reference, disable_dropout
    from toolkit.runtime.objectives.step import PreferenceStep

    disable_dropout(model)
    if cfg.train.objective == "reward":  # transformers scores each row's last token that is not padding
        model.config.pad_token_id = pad_id

    reference = build_reference(cfg, p.model_config, p.ds, keep_alive, r) if r.reference == "engine" else None
    step = PreferenceStep(cfg, r.reference, model, reference)
    step.eval_rows, step.collate = eval_rows, PairCollator(pad_id, r.packing, r.attention.boundaries)
    if r.reference == "precomputed":
        from toolkit.runtime.objectives import precompute

        step.stored = (p.run_dir, precompute.cache_dir(cfg.data.cache_dir),
                       precompute.key_of(cfg, r, rows, p.data_world, eval_rows, p.model_config))
    return step


def _generation(p: RunSpec, tokenizer: Any, rows: Rows, metrics: MetricsLogger
                ) -> Callable[[Any, int, bool], None] | None:
    """eval.generate: generate(engine, step, final), which every rank calls (a collective under ZeRO-3). The
    prompt file was checked before launch (spec.py); here it is tokenized, before the engine starts."""
    if not p.cfg.eval.generate:
        return None
    from toolkit.runtime.generation.evaluate import run_eval_generation, run_prompts

    prompts = run_prompts(p, tokenizer, rows)

    def generate(engine: Any, step: int, final: bool) -> None:
        with compiling.eager():  # compiled layers decode eagerly (toolkit/runtime/speed/compile.py)
            run_eval_generation(p, engine, tokenizer, prompts, step, final, metrics.log_generation)

    return generate


def _finish(p: RunSpec, engine: Any, tokenizer: Any, rows: Rows, pad_id: int, stopped: bool,
            generate: Callable[[Any], None] | None, fixed_batch: dict[str, Any]) -> None:
    cfg = p.cfg
    if cfg.train.save_probe:
        _save_probe(p, engine, rows, pad_id)
    if stopped:
        return
    if generate is not None:
        generate(engine)
    if not cfg.train.export:
        return
    out = p.run_dir / ("adapter" if cfg.lora.enabled else "export")
    t0 = time.perf_counter()
    # the export held to the trained model before it is marked done (faults/export_check.py)
    verify = export_check.prepare(cfg, engine, fixed_batch, bool(p.resolved.fp8), p.precision,
                                  p.resolved.liger.enabled)
    export_model(engine, out, tokenizer, verify)
    if dist.rank() == 0:
        print(f"exported {out} in {time.perf_counter() - t0:.2f}s", flush=True)


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
