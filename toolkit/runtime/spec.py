"""The run spec: every input read once, and everything decided before the process group exists.

parse -> Config -> `read_inputs()`: the DeepSpeed JSON loaded, the model's HF config derived and the world
size read, once -> (`train.micro_batch_size=auto` chooses from these) -> `build_spec()`: checks (one clear
error, no hang), precision, the resolved DeepSpeed dict (no "auto" left), the step count, then every other
setting resolved once into the record (runtime/resolved.py). train.py builds it; the loops (runtime/loops/) and
generate.py consume it and re-read none of its inputs; keeping it here keeps those three from importing each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config import optimizers
from toolkit.config.ds_config import (
    AutoValues,
    ConfigError,
    adapter_autocast,
    load_ds_config,
    offload,
    precision_of,
    resolve,
    zero_stage,
)
from toolkit.config.models import text_config
from toolkit.config.schema import Config
from toolkit.launch import dist
from toolkit.observe import trackers
from toolkit.runtime.faults.resume import Checkpoint, Reshard, find, reshard_for, universal_config
from toolkit.runtime.resolved import Machine, Resolved, precision_of_run, resolve_run, tiled_mlp_choice


@dataclass(frozen=True)
class RunInputs:
    """What the entry reads, once: nothing below reads these files or derives the model's shape again."""

    cfg: Config  # mutable inside: autotune sets the micro-batch, resume on another rank count the accumulation
    ds_raw: dict[str, Any]  # the DeepSpeed JSON as written ("auto" unresolved)
    model_config: Any  # the model's HF config (a preset's, or a local directory's config.json)
    world_size: int


def read_inputs(cfg: Config, world_size: int | None = None, files: str = "model") -> RunInputs:
    """world_size: the launcher's (None), or the one `toolkit check --explain` is asked about. files: what a hub id
    fetches ("config" for check: config.json alone)."""
    from toolkit.hub.datasets import local_source
    from toolkit.runtime.model import model_config

    d = cfg.data  # a hub dataset id: its split's file in the pinned snapshot, read from here on as a local file is
    d.source = local_source(d.source, d.split, d.revision, "data.source")
    d.eval_source = local_source(d.eval_source, d.eval_split, d.revision, "data.eval_source")
    return RunInputs(cfg, load_ds_config(cfg.train.ds_config), model_config(cfg, files),
                     dist.world_size() if world_size is None else world_size)


@dataclass
class RunSpec:
    """Everything decided before the process group exists; `resolved` holds every setting with its reason."""

    cfg: Config
    ds: dict[str, Any]  # resolved: no "auto" left
    model_config: Any
    run_dir: Path
    world_size: int
    total_steps: int | None  # None until a data file is tokenized (max_steps=0, one epoch)
    warnings: list[str]
    resolved: Resolved  # every auto and derived setting, decided once (toolkit/runtime/resolved.py)
    resume_from: Checkpoint | None = None  # train.resume: the complete checkpoint found
    reshard: Reshard | None = None  # ... written on another number of ranks: loaded as a universal checkpoint
    autotune: dict[str, Any] | None = None  # train.micro_batch_size=auto: the probes and the choice

    @property
    def precision(self) -> str:
        return self.resolved.precision

    @property
    def adapter_autocast(self) -> bool:
        """LoRA under bf16: fp32 adapters, bf16 frozen base, torch autocast."""
        return self.resolved.adapter_autocast

    @property
    def fp8(self) -> str | None:
        """train.precision=fp8: the float8 recipe (precision is then bf16, DeepSpeed's mode)."""
        return self.resolved.fp8

    @property
    def data_world(self) -> int:
        """Ranks that draw their own batches: all of them, or the groups under train.sequence_parallel."""
        return self.world_size // self.cfg.train.sequence_parallel


def build_spec(inputs: RunInputs, machine: Machine | None = None, ranks_per_node: int = 1) -> RunSpec:
    """All input validation that can run before init_process_group: one clear error, no hang; then every setting
    resolved once (toolkit/runtime/resolved.py). machine: what the decisions read of it (None: this one, with
    ranks_per_node where the launcher does not say)."""
    from toolkit.runtime.data.batches import check_data_file, steps_per_epoch
    from toolkit.runtime.model import hidden_size

    cfg, ds_raw, mc, world = inputs.cfg, inputs.ds_raw, inputs.model_config, inputs.world_size
    t = cfg.train
    trackers.check(cfg.metrics.report_to)  # a missing wandb/mlflow is one line here, not a rank-0 crash later
    machine = machine or Machine.here(cfg, ranks_per_node)
    precision_why = precision_of_run(cfg, precision_of(ds_raw), machine)
    precision = precision_why[0]
    if t.precision == "fp8":
        from toolkit.runtime.speed import fp8

        fp8.check(cfg, machine.capability, machine.gpu_name)
    autocast = adapter_autocast(ds_raw, precision, cfg.lora.enabled)
    if t.resume:
        _check_resume_mode(Path(t.run_dir), autocast)
    # before the batch checks: on another rank count, resume changes grad_accum to keep the global batch
    _check_sequence_parallel(cfg, mc, ds_raw, world)
    ckpt, reshard, notes = _resume(cfg, world, ds_raw)
    ranks = world  # what the global batch counts: ranks drawing their own batches
    if t.sequence_parallel > 1:
        world = world // t.sequence_parallel  # (the ranks of a sequence-parallel group share each batch)
        ranks = f"{world} sequence-parallel groups"
    batch = t.micro_batch_size * t.grad_accum * world
    if t.global_batch_size and batch != t.global_batch_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} but micro_batch_size {t.micro_batch_size} x "
                          f"grad_accum {t.grad_accum} x {ranks}{' ranks' * isinstance(ranks, int)} = {batch}; "
                          "fix one, or set train.micro_batch_size=auto")
    warnings = notes + _run_checks(ds_raw, cfg, world) + _single_gpu_zero3(ds_raw, world) + _check_4bit(cfg, ds_raw)
    if t.objective == "sft":
        check_data_file(cfg)
    else:
        _check_objective(cfg)
    _check_generation(cfg)
    _check_vocabulary(cfg, mc)
    # max_steps=0 means one epoch: known here for synthetic data, after tokenizing for a file
    # (loops/run.py fills it then; a DeepSpeed scheduler "auto" needing it is reported as unfillable).
    synthetic = cfg.data.source == "synthetic"
    total = t.max_steps or (steps_per_epoch(cfg.data.num_samples, cfg, world) if synthetic else None)
    if t.profile_steps and total and t.profile_steps[0] > total:
        raise ConfigError(f"train.profile_steps={list(t.profile_steps)} starts after the run's last step ({total}): "
                          "the profiler would never start; pick steps within train.max_steps")
    t.grad_clip = _grad_clip(cfg, ds_raw)  # unset: decided here once, for both paths
    values = AutoValues(micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, world_size=world,
                        precision=precision, grad_clip=t.grad_clip, lr=t.lr, muon_lr=t.muon_lr,
                        betas=(t.betas[0], t.betas[1]),
                        eps=t.eps, weight_decay=t.weight_decay, hidden_size=hidden_size(mc),
                        warmup_steps=t.warmup_steps, total_steps=total, adapter_autocast=autocast,
                        zero_sizes=t.zero_sizes)
    ds = resolve(ds_raw, values)
    if t.sequence_parallel > 1 and t.path == "raw":
        # read where no mpu is passed (zero.Init under ZeRO-3): the data-parallel size
        ds["sequence_parallel_size"] = t.sequence_parallel
    elif t.sequence_parallel > 1:
        # the HF Trainer's engine gets no mpu (sequence/ulysses.py): to DeepSpeed and to the Trainer's own check
        # every rank is data-parallel, so its batch counts all of them; the global batch above counts groups
        ds["train_batch_size"] = t.micro_batch_size * t.grad_accum * inputs.world_size
    if reshard:
        ds = universal_config(ds)
    world = inputs.world_size
    record = resolve_run(cfg, ds, mc, world, precision=precision_why, adapter_autocast=autocast, total_steps=total,
                     machine=machine)
    return RunSpec(cfg, ds, mc, Path(t.run_dir), world, total, warnings, record, ckpt, reshard)


def _grad_clip(cfg: Config, ds: dict[str, Any]) -> float:
    """train.grad_clip as the run applies it: unset, 1.0 or off under Muon at ZeRO 1-3 (optimizers.default_grad_clip);
    a clip there is refused, since DeepSpeed would clip Muon's update instead of the gradient."""
    stage = zero_stage(ds)
    clip = cfg.train.grad_clip
    if clip is None:
        return optimizers.default_grad_clip(ds)
    if clip > 0 and optimizers.clips_muon_update(ds, stage):
        raise ConfigError(f"train.grad_clip={clip} with Muon at ZeRO-{stage}: DeepSpeed clips Muon's orthogonalized "
                          "update, not the gradient, which shrinks every step by the norm of all the updates; "
                          "leave train.grad_clip unset (off here) or train at ZeRO-0")
    return float(clip)


def _check_objective(cfg: Config) -> None:
    """A preference run: what it supports so far, and its pair file row by row, before launch."""
    t, d = cfg.train, cfg.data
    refusals = [
        (t.objective != "reward" and cfg.model.task != "causal_lm", f"needs model.task=causal_lm, not {cfg.model.task}"),
        (t.objective == "reward" and cfg.model.task != "seq_cls",
         "trains a sequence classifier with one output: add model.task=seq_cls"),
        (t.sequence_parallel > 1, "does not run with train.sequence_parallel yet"),
        # the reference must compute what the policy computes at step 1: the same kernels, eager, in bf16 or fp32
        (t.precision == "fp8", "does not run in float8 yet (the reference would not match the policy)"),
        (t.compile == "torch", "does not compile yet (the reference would not match the policy): train.compile=off"),
    ]
    if t.objective == "grpo":
        refusals += [
            (t.path != "raw", "runs on the raw path so far: train.path=raw"),
            (cfg.data.source == "synthetic", "needs a prompt file: data.source=prompts.jsonl (docs/rl.md)"),
            (bool(d.eval_source or d.eval_fraction), "has no held-out evaluation yet: drop data.eval_source / "
                                                     "data.eval_fraction"),
            (cfg.eval.generate and not cfg.eval.generate_source,
             "samples its own completions (run_dir/completions.jsonl): eval.generate needs eval.generate_source"),
            (cfg.rl.beta > 0 and cfg.pref.reference == "precomputed",
             "cannot precompute its reference (the completions are new every step): pref.reference=auto"),
        ]
    for bad, why in refusals:
        if bad:
            raise ConfigError(f"train.objective={t.objective} {why}")
    if t.objective == "grpo":
        from toolkit.runtime.rl import prompts, rewards

        rewards.load(cfg.rl.rewards, list(cfg.rl.reward_weights), cfg.rl.max_completion_length)  # imports the file
        prompts.check_file(d.source)  # the rows alone; their tokenizer and ids: _check_vocabulary
        return
    from toolkit.runtime.objectives.pairs import check_file

    for what, source in (("data.source", d.source), ("data.eval_source", d.eval_source)):
        if source and source != "synthetic":
            check_file(source, what, kto=t.objective == "kto")


def _check_vocabulary(cfg: Config, mc: Any) -> None:
    """A tokenizer with more ids than the model's embedding has rows would fail deep in the first forward (an
    IndexError in the embedding); where a file is tokenized, say so before launch."""
    if cfg.data.source == "synthetic" and not (cfg.data.eval_source or cfg.eval.generate_source):
        return
    from toolkit.runtime.model import build_tokenizer

    tok = build_tokenizer(cfg)
    vocab = getattr(text_config(mc), "vocab_size", None)
    if cfg.train.objective == "grpo":  # text and chat prompts need the tokenizer, ids the model's vocabulary
        from toolkit.runtime.rl import prompts

        prompts.check_file(cfg.data.source, tokenizer=tok, vocab=vocab, need_tokenizer=True)
    if tok is not None and vocab and len(tok) > vocab:
        raise ConfigError(f"the tokenizer ({cfg.model.tokenizer or cfg.model.name}) has {len(tok):,} ids but the model "
                          f"{cfg.model.name} embeds {vocab:,}: take the model's own tokenizer, or a model whose "
                          "vocabulary holds it")


def _check_generation(cfg: Config) -> None:
    """eval.generate's prompt file, row by row, before launch (a bad row would otherwise surface after training)."""
    e = cfg.eval
    if (e.generate_source or e.generate_every) and not e.generate:
        key = "eval.generate_source" if e.generate_source else "eval.generate_every"
        raise ConfigError(f"{key} is set but eval.generate is false: nothing would generate; add eval.generate=true")
    if e.generate_source:
        from toolkit.runtime.generation.prompts import check_file

        check_file(Path(e.generate_source), "eval.generate_source")


def _check_4bit(cfg: Config, ds: dict[str, Any]) -> list[str]:
    """model.load_in_4bit: bitsandbytes is there (one line if not); the warning for parameter offload."""
    if not cfg.model.load_in_4bit:
        return []
    from toolkit.runtime import quant

    why = quant.available()
    if why:
        raise ConfigError(why)
    z = ds.get("zero_optimization") or {}
    if (z.get("offload_param") or {}).get("device", "none") not in ("none", None):
        return ["model.load_in_4bit with ZeRO-3 parameter offload: the 4-bit base is already small, and with QLoRA "
                "CPU offload has been seen to use more GPU memory, not less (PEFT's DeepSpeed caveats); drop "
                "offload_param first"]
    return []


def _check_sequence_parallel(cfg: Config, mc: Any, ds: dict[str, Any], world: int) -> None:
    from toolkit.config.checks.sequence import problems

    t = cfg.train
    text = text_config(mc)
    heads = getattr(text, "num_attention_heads", None)
    found = problems(t.sequence_parallel, world, zero_stage(ds), heads, getattr(text, "num_key_value_heads", heads),
                     cfg.data.seq_len, cfg.model.attn_implementation, cfg.model.task, t.micro_batch_size)
    if t.sequence_parallel > 1 and getattr(text, "num_experts_per_tok", None):
        found.append("train.sequence_parallel with a Mixture-of-Experts model: not supported yet (the load-balancing "
                     "loss would see each rank's slice)")
    tiled, why = tiled_mlp_choice(cfg)
    if tiled and t.precision == "fp8":
        found.append(f"train.precision=fp8 with tiled MLPs ({why}): not tested together here yet; set "
                     "model.tiled_mlp=false or train.precision=bf16")
    if found:
        raise ConfigError("\n".join(found))


def _resume(cfg: Config, world: int, ds: dict[str, Any]) -> tuple[Checkpoint | None, Reshard | None, list[str]]:
    """The checkpoint train.resume names, and on another rank count the accumulation that keeps its global
    batch (set on cfg, so the checks, the DeepSpeed dict and config.yaml all see what runs)."""
    t = cfg.train
    if not t.resume:
        return None, None, []
    try:
        ckpt = find(Path(t.run_dir), t.path, t.resume)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    saved_sp = int(ckpt.record.get("sequence_parallel", 1))
    if saved_sp != t.sequence_parallel:
        raise ConfigError(f"train.resume: {ckpt.dir.name} was written at train.sequence_parallel={saved_sp}; resume "
                          f"it at {saved_sp} (moving a checkpoint to another sequence-parallel degree is not supported)")
    if saved_sp > 1 and ckpt.record.get("world_size") != world:
        raise ConfigError(f"train.resume: {ckpt.dir.name} was written on {ckpt.record.get('world_size')} ranks with "
                          f"train.sequence_parallel={saved_sp}; resume it on the same number of ranks")
    reshard = reshard_for(ckpt, t.micro_batch_size, t.grad_accum, world)
    if not reshard:
        saved = ckpt.record.get("global_batch")
        world //= t.sequence_parallel  # the batch counts data-parallel groups
        if saved and saved != t.micro_batch_size * t.grad_accum * world:
            # the batch order and the schedule continue from step x global batch: another batch breaks both
            raise ConfigError(f"train.resume: {ckpt.dir.name} trained a global batch of {saved}; this run would use "
                              f"micro_batch_size {t.micro_batch_size} x grad_accum {t.grad_accum} x {world} ranks = "
                              f"{t.micro_batch_size * t.grad_accum * world}; keep {saved} to continue the same run")
        return ckpt, None, []
    if ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme":
        # DeepSpeed skips the ZeRO load under NVMe offload and reads offloaded_tensors/, which the
        # universal converter never writes (engine.py load_checkpoint): it would fail after converting
        raise ConfigError(f"train.resume: {ckpt.dir.name} was written on {reshard.saved_world} ranks; resuming on "
                          f"{world} needs a universal checkpoint, which DeepSpeed cannot load with NVMe optimizer "
                          f"offload; resume on {reshard.saved_world} ranks or offload to cpu")
    if t.global_batch_size and t.global_batch_size != reshard.global_batch:
        raise ConfigError(f"train.resume: {ckpt.dir.name} trained a global batch of {reshard.global_batch}, "
                          f"train.global_batch_size asks for {t.global_batch_size}; keep {reshard.global_batch}")
    t.grad_accum = reshard.grad_accum
    return ckpt, reshard, [f"train.resume: {ckpt.dir.name} was written on {reshard.saved_world} ranks (global batch "
                           f"{reshard.global_batch}); on {world} rank{'s' * (world > 1)} grad_accum is {reshard.grad_accum}: the same "
                           "global batch, so the batch order and the schedule continue"]


def _check_resume_mode(run_dir: Path, autocast: bool) -> None:
    """Checkpoints written under one LoRA precision mode do not load under the other (another
    optimizer wrapper, other file names), so stop before training and say how to get the old one back."""
    try:
        before = bool(json.loads((run_dir / "versions.json").read_text()).get("adapter_autocast", False))
    except (OSError, ValueError, AttributeError):
        return  # no record (or an unreadable one): nothing to compare with
    if before != autocast:
        how = ('set "bf16": {"enabled": true} in the DeepSpeed JSON' if not before else
               'leave bf16.enabled "auto" and add no torch_autocast block, below ZeRO-3')
        raise ConfigError(f"train.resume: the checkpoints in {run_dir} were written with adapter_autocast={before} "
                          f"(versions.json) and this run would use {autocast}; to resume them, {how}")


def _single_gpu_zero3(ds: dict[str, Any], world: int) -> list[str]:
    """ZeRO-3 on one GPU without parameter offload: a note, not a check-table rule, because `toolkit check`
    assumes one rank unless told otherwise, and on CPU (the Quickstart's demo) speed is not the point."""
    if world != 1 or dist.on_cpu() or zero_stage(ds) != 3 or offload(ds, "offload_param")[0] != "none":
        return []
    return ["note: ZeRO-3 on one GPU shards nothing (each parameter's one partition is the whole of it) and "
            "pays ZeRO-3's per-module gathers: on one H200, GPT-2 and Qwen2-0.5B ran 1.9-2.6x slower than at "
            "ZeRO-2, at the same peak within 1 GiB (bench/results/speed.md, runs s8, s14, s15). Use ZeRO-2 (with "
            "offload_optimizer if the optimizer does not fit), or ZeRO-3 with offload_param."]


def _run_checks(ds: dict[str, Any], cfg: Config, world: int) -> list[str]:
    from toolkit.config.checks import check_config

    findings = check_config(ds, world_size=world, consumer=cfg.train.path,
                            micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        lines = "\n  ".join(f"{f.key}: {f.message}" for f in errors)
        raise ConfigError(f"{cfg.train.ds_config} will not run (toolkit check):\n  {lines}")
    return [f"warning: {f.key}: {f.message}" for f in findings if f.level == "warning"]


def explain(config: str | None, ds: str, overrides: list[str], world_size: int, as_json: bool = False,
            target: Machine | None = None) -> int:
    """`toolkit check DS --explain`: the run's resolved record for a training config and world size, on this
    machine or on `target` (the GPU nodes, `Machine.target`), without launching (the block a run prints first;
    --json: what it writes to resolved.json)."""
    from toolkit.config.schema import load_config

    notes = dist.prepare_env()  # the accelerator the run would pick (CPU ranks where no GPU is)
    if target is not None:
        notes = [f"resolved for {world_size} ranks on GPU nodes of {target.ranks_per_node} x {target.gpu_name}, "
                 "not for this machine"]
    try:
        cfg = load_config(config, overrides)
        cfg.train.ds_config = ds
        if cfg.train.micro_batch_size == "auto":
            raise ConfigError("train.micro_batch_size=auto is found by probes at launch; give a number here (toolkit "
                              "plan predicts which fit) to see the rest of the run's settings")
        spec = build_spec(read_inputs(cfg, world_size, files="config"), machine=target,
                          ranks_per_node=world_size)  # one node, as a launch here
    except ConfigError as e:
        print(f"error: {e}")
        return 1
    if as_json:
        print(json.dumps(spec.resolved.to_dict(), indent=1))
        return 0
    print("\n".join([*notes, *spec.warnings, *spec.resolved.lines()]))
    return 0
