"""The resolved record: every `auto` and every derived setting of a run, decided once, each with its reason.

`spec.build_spec()` calls `resolve_run()`, before the process group exists (under `train.micro_batch_size=auto`
after the probes that choose the micro-batch, which need it). The two training paths, the planner's
run settings and `toolkit check --explain` read the record; none of them decides again. Rank 0 prints it as one
block at the start of a run (`Resolved.lines`) and writes it to run_dir/resolved.json (`Resolved.to_dict`); a
resumed run compares it with the saved one (`changes`). Where the built model cannot take a decision (model.tiled_loss
=auto on a model without a decoder and output embeddings; float8 where no Linear is large enough), the run says so
in its log when it applies the record (loops/build.py).

The rules themselves are pure and shared with `toolkit plan` (toolkit/plan/speedups.py, liger.py, experts.py,
attention.plan); what they read of the machine is read once, into `Machine`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from toolkit import hub
from toolkit.config import ds_defaults
from toolkit.config.attention import has_sdpa
from toolkit.config.ds_config import ConfigError, zero_stage
from toolkit.config.models import text_config
from toolkit.config.schema import Config, packing
from toolkit.launch import dist
from toolkit.plan.experts import ExpertsChoice
from toolkit.plan.liger import LigerChoice
from toolkit.plan.speedups import (
    compile_on,
    leaves_blocked,
    leaves_gathered_gib,
    leaves_on,
    tiled_loss_on,
    tiled_loss_tile,
    tiled_mlp_on,
)
from toolkit.runtime.attention import AttentionPlan
from toolkit.runtime.sequence.offload import Plan as OffloadPlan

RECORD = "resolved.json"


@dataclass(frozen=True)
class Machine:
    """What the decisions read of the machine the run is on, read once (`here`), or given (tests, `toolkit check`)."""

    cuda: bool
    """A CUDA GPU trains (not DS_ACCELERATOR=cpu)."""
    varlen: bool
    """torch's variable-length attention kernel is there (CUDA, torch 2.10+)."""
    liger_types: tuple[str, ...] | None
    """Model types Liger patches; None: liger-kernel not importable (or no CUDA)."""
    gpu_bytes: int
    """One GPU as the run may use it: the whole card, or memory.gpu_limit_gib plus the planner's CUDA context."""
    host_bytes: float | None
    """This host's memory (or the container's limit); None if unknown."""
    ranks_per_node: int
    bf16: bool = False
    """The GPU computes in bf16 (what train.precision=auto picks there)."""
    capability: tuple[int, int] | None = None
    """The GPU's (SM major, minor); None without CUDA. float8 needs 8.9+ (speedups.fp8_support_error)."""
    gpu_name: str = ""

    @classmethod
    def target(cls, gpu_mem_gib: float, gpus_per_node: int, host_mem_gib: float | None = None) -> Machine:
        """A GPU node described as `toolkit plan` takes it (--gpu-mem, --gpus, --host-mem), for `toolkit check
        --explain` on a machine without those GPUs (a login node): CUDA, bf16, torch's variable-length attention,
        Liger for the types the planner counts it on, an SM 9.0 card (H100/H200)."""
        from toolkit.plan.liger import LIGER_MODEL_TYPES

        return cls(True, True, tuple(sorted(LIGER_MODEL_TYPES)), int(gpu_mem_gib * 2**30),
                   None if host_mem_gib is None else host_mem_gib * 2**30, gpus_per_node, True, (9, 0),
                   f"a {gpu_mem_gib:g} GiB GPU (--gpu-mem)")

    @classmethod
    def here(cls, cfg: Config, ranks_per_node: int = 1) -> Machine:
        """ranks_per_node: where the launcher sets neither LOCAL_SIZE nor LOCAL_WORLD_SIZE."""
        import torch

        from toolkit.plan.planner import CUDA_CONTEXT_GIB
        from toolkit.runtime.sequence.offload import host_memory_bytes
        from toolkit.runtime.speed.kernels import supported_model_types

        cuda = torch.cuda.is_available() and not dist.on_cpu()
        gpu = 0
        varlen = False
        if cuda:
            from toolkit.runtime.attention.kernels import varlen_available

            varlen = varlen_available(torch.device("cuda"))
            total = torch.cuda.get_device_properties(dist.local_rank() % torch.cuda.device_count()).total_memory
            limit = cfg.memory.gpu_limit_gib
            # dist.gpu_memory_bytes's rule, before the cap exists: the cap plus a context outside it
            gpu = total if limit <= 0 else min(total, min(total, int(limit * 2**30)) + int(CUDA_CONTEXT_GIB * 2**30))
        types = supported_model_types() if cuda else None
        capability, name = (None, "")
        if cuda:
            from toolkit.runtime.speed.fp8 import gpu_capability as sm

            capability, name = sm(dist.local_rank())
        local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
        return cls(cuda, varlen, tuple(sorted(types)) if types is not None else None, gpu, host_memory_bytes(),
                   int(local) if local else ranks_per_node, cuda and torch.cuda.is_bf16_supported(),
                   capability and (int(capability[0]), int(capability[1])), name)


@dataclass(frozen=True)
class Resolved:
    """A run's settings as it will run them, each with the reason (the `*_why` fields and the plans' notes)."""

    world_size: int
    stage: int
    precision: str
    precision_why: str
    fp8: str | None
    """train.precision=fp8: the float8 recipe (precision is then bf16, DeepSpeed's mode)."""
    adapter_autocast: bool
    micro_batch: int
    grad_accum: int
    batch_why: str
    total_steps: int | None
    """None until a data file is tokenized (train.max_steps=0: one epoch)."""
    packing: bool
    packing_why: str
    attention: AttentionPlan
    compile: bool
    compile_why: str
    compile_note: str | None
    """ZeRO-3 under compile: what was done to DeepSpeed's linear (speed.compile.plain_linear), or None."""
    zero3_leaves: bool
    """The decoder layers are ZeRO-3 leaf modules (train.zero3_leaves resolved: speedups.leaves_on)."""
    zero3_leaves_why: str
    tiled_mlp: bool
    tiled_mlp_why: str
    tiled_loss: bool
    tiled_loss_why: str
    tiled_loss_tile: int
    liger: LigerChoice
    experts: ExpertsChoice | None
    activation_offload: OffloadPlan
    machine: Machine
    objective: str = "sft"
    """train.objective; with reference the preference run's reference model (objectives/reference.py), or None."""
    reference: str | None = None
    objective_why: str = "next-token loss"
    optimizer_why: str = "AdamW"
    """The optimizer section, its state dtype and the gradient clipping as the run applies them."""
    stochastic_rounding: bool = False
    """train.bf16_rounding: torchao's AdamW rounds into the bf16 masters stochastically (runtime/low_precision.py)."""
    deepspeed_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    """DeepSpeed's defaults that changed across its versions, as this run gets them (config/ds_defaults.py)."""
    hub: list[dict[str, Any]] = field(default_factory=list)
    """Hub ids this run resolved: id, the revision asked, the commit sha, the local snapshot (toolkit/hub)."""

    def lines(self, kv_heads: str | None = None) -> list[str]:
        """The block a run prints at its start (and `toolkit check --explain`). kv_heads: how the varlen kernel takes
        grouped kv heads on this GPU, probed at the start of a run (attention.install), not part of the record."""
        world = f"{self.world_size} rank{'s' * (self.world_size > 1)}"
        out = [f"resolved settings (in the run dir's {RECORD}; toolkit check DS --explain prints them before a launch):",
               f"  ZeRO-{self.stage}, {world}, {self.precision} ({self.precision_why})"
               + (f", float8 {self.fp8}" if self.fp8 else "")
               + (", LoRA adapters in fp32 under autocast" if self.adapter_autocast else ""),
               f"  batch: {self.batch_why}",
               f"  {self.packing_why}; {self.attention_note(kv_heads)}",
               f"  {self.liger.describe()}"]
        if self.experts is not None:
            out.append(f"  {self.experts.describe()}")
        out.append(f"  torch.compile: {'on' if self.compile else 'off'} ({self.compile_why})")
        if self.stage == 3:
            out.append(f"  ZeRO-3 leaf modules (decoder layers): {'on' if self.zero3_leaves else 'off'} "
                       f"({self.zero3_leaves_why})")
        if self.compile_note:
            out.append(f"  {self.compile_note}")
        out.append(f"  MLP tiled over the sequence: {'on' if self.tiled_mlp else 'off'} ({self.tiled_mlp_why})")
        tile = f"; tiles of {self.tiled_loss_tile:,} tokens" if self.tiled_loss else ""
        out.append(f"  logits and loss tiled over the sequence: {'on' if self.tiled_loss else 'off'} "
                   f"({self.tiled_loss_why}{tile})")
        out.append(f"  {self.activation_offload.describe()}")
        if self.objective != "sft":
            out.append(f"  objective: {self.objective_why}")
        out.append(f"  optimizer: {self.optimizer_why}")
        for h in self.hub:
            how = "from the cache (offline)" if h["offline"] else "from the hub"
            out.append(f"  {h['id']}: revision {h['revision'] or 'the default branch'} = commit {h['sha']}, "
                       f"{'config.json' if h['files'] == 'config' else h['files'] + ' files'} {how}, in {h['path']}")
        if self.deepspeed_defaults:
            out.append(f"  {ds_defaults.describe(self.deepspeed_defaults)}")
        return out

    def attention_note(self, kv_heads: str | None = None) -> str:
        return self.attention.note + (f" (kv heads: {kv_heads})" if kv_heads else "")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["liger"]["external_head"] = self.liger.external_head
        return d

    def versions(self, kv_heads: str | None = None) -> dict[str, Any]:
        """The decisions versions.json has always carried (toolkit report and older tools read them there)."""
        return {"world_size": self.world_size, "precision": self.precision, "adapter_autocast": self.adapter_autocast,
                "liger": self.liger.kwargs, "liger_note": self.liger.describe(), "packing": self.packing,
                "attention": self.attention.implementation, "attention_note": self.attention_note(kv_heads),
                "tiled_mlp": self.tiled_mlp, "activation_offload": self.activation_offload.describe(),
                "compile": self.compile, "compile_note": self.compile_why, "fp8": self.fp8,
                "experts_note": self.experts.describe() if self.experts else None}


def changes(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """What differs between a saved record and this run's, one `key: before -> now` per leaf (the machine's
    figures included: another GPU or host is worth a line too)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def precision_of_run(cfg: Config, pinned: str | None, machine: Machine) -> tuple[str, str]:
    """(DeepSpeed's precision mode, why): train.precision, the JSON's pinned mode, or auto for the machine."""
    t = cfg.train
    if t.precision == "fp8":  # float8 matmuls inside DeepSpeed's bf16 mode
        if pinned not in (None, "bf16"):
            raise ConfigError(f"train.precision=fp8 trains in DeepSpeed's bf16 mode; {t.ds_config} pins "
                              f"{pinned}: set bf16.enabled to \"auto\" or true")
        return "bf16", "train.precision=fp8: float8 matmuls in DeepSpeed's bf16 mode"
    if t.precision != "auto":
        return t.precision, f"train.precision={t.precision}"
    if pinned is not None:
        return pinned, f"train.precision=auto: {t.ds_config} enables {pinned}"
    if not machine.cuda:
        return "fp32", "train.precision=auto: CPU ranks"
    if machine.bf16:
        return "bf16", "train.precision=auto: the GPU supports bf16"
    return "fp32", "train.precision=auto: the GPU has no bf16"


def compile_choice(cfg: Config, ds: dict[str, Any], cuda: bool, steps: int | None) -> tuple[bool, str]:
    """train.compile with auto resolved (speedups.compile_on, then tiled MLPs); also what the probes of
    `train.micro_batch_size=auto` run."""
    if cfg.train.objective != "sft" and cfg.train.compile == "auto":  # the reference is built eager (objectives/)
        return False, f"train.compile=auto: off for train.objective={cfg.train.objective} (not compiled yet)"
    on, why = compile_on(cfg.train.compile, cuda=cuda, steps=steps, fp8=cfg.train.precision == "fp8",
                         stage=zero_stage(ds), no_leaves=_no_leaves(cfg, ds))
    if on and cfg.train.compile == "auto" and tiled_mlp_choice(cfg)[0]:  # correct compiled (tests), speed not measured
        return False, ("train.compile=auto with tiled MLPs: their compiled speed is not measured yet; "
                       "train.compile=torch compiles")
    return on, why


def _no_leaves(cfg: Config, ds: dict[str, Any]) -> str | None:
    """Why this run's decoder layers cannot be ZeRO-3 leaf modules, or None."""
    if cfg.train.zero3_leaves == "false":
        return "with train.zero3_leaves=false"
    return leaves_blocked(lora=bool(cfg.lora.enabled), ds=ds)


def leaves_choice(cfg: Config, ds: dict[str, Any], compiled: bool, model_config: Any, world: int,
                  gpu_bytes: int) -> tuple[bool, str]:
    """train.zero3_leaves resolved (speedups.leaves_on); ConfigError where true cannot be honoured."""
    from toolkit.plan.shapes import shape_of_config

    stage = zero_stage(ds)
    model_type = str(getattr(model_config, "model_type", ""))

    def decide(held: float) -> tuple[bool, str]:
        try:
            return leaves_on(cfg.train.zero3_leaves, stage=stage, compiled=compiled,
                             blocked=leaves_blocked(lora=bool(cfg.lora.enabled), ds=ds),
                             model_type=model_type, objective=cfg.train.objective, gathered_gib=held,
                             gpu_gib=gpu_bytes / 2**30)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    on, why = decide(0.0)
    # what leaf layers would keep gathered with checkpointing (auto: off where large; CPU ranks: not checked); the
    # model's shape is read (on the meta device) only where leaves would otherwise be taken
    if on and gpu_bytes and cfg.model.gradient_checkpointing:
        off = (ds.get("zero_optimization") or {}).get("offload_param") or {}
        held = leaves_gathered_gib(shape_of_config(model_config, trace=False).total_params, stage=stage, grad_ckpt=True,
                                   world=world, offload_param=isinstance(off, dict) and off.get("device") in ("cpu", "nvme"))
        return decide(held)
    return on, why


def tiled_mlp_choice(cfg: Config) -> tuple[bool, str]:
    return tiled_mlp_on(cfg.model.tiled_mlp, cfg.data.seq_len, cfg.train.sequence_parallel)


def resolve_run(cfg: Config, ds: dict[str, Any], model_config: Any, world: int, *, precision: tuple[str, str],
            adapter_autocast: bool, total_steps: int | None, machine: Machine) -> Resolved:
    """The one place a run's settings are decided. ds: the resolved DeepSpeed dict (under compile at ZeRO-3 this
    sets memory_efficient_linear in it, before the model is built). ConfigError: a choice that cannot run here."""
    from toolkit.runtime import attention, moe
    from toolkit.runtime.model import hidden_size
    from toolkit.runtime.speed.compile import plain_linear

    t, m = cfg.train, cfg.model
    stage = zero_stage(ds)
    fp8 = t.fp8_recipe if t.precision == "fp8" else None
    compiled, compile_why = compile_choice(cfg, ds, machine.cuda, total_steps)
    leaves, leaves_why = leaves_choice(cfg, ds, compiled, model_config, world, machine.gpu_bytes)
    tiled, tiled_why = tiled_mlp_choice(cfg)
    compile_note = plain_linear(ds) if compiled and stage == 3 else None
    from toolkit.plan.liger import choose

    fused = moe.fused_loss_setting(cfg, model_config, ds, world, compiled, tiled, machine.gpu_bytes)
    liger = choose(m.liger, cuda=machine.cuda, model_type=model_config.model_type, task=m.task, stage=stage,
                   supported=frozenset(machine.liger_types) if machine.liger_types is not None else None,
                   fused_loss=fused[0], compiled=compiled, fused_off_reason=fused[1], objective=t.objective,
                   chunk_mem_const=m.liger_chunk_mem_const)
    experts = moe.choose_path(cfg, model_config, liger)
    if experts is not None:
        liger = moe.with_experts(liger, experts, model_config.model_type)
    packed, packing_why = packing(cfg)
    # unpacked rows of a sliding-window model through the window kernel: a fine-tune's rows only (preference pairs
    # and rollouts have their own collators)
    window = attention.sliding_window(model_config, cfg.data.seq_len) if t.objective == "sft" else None
    attn = attention.plan(m.attn_implementation, m.task, packed, machine.cuda, machine.cuda and machine.varlen,
                          t.sequence_parallel, window, sdpa=m.task != "causal_lm" or has_sdpa(model_config))
    loss_on, loss_why = tiled_loss_on(m.tiled_loss, fused_loss=bool(liger.kwargs.get("fused_linear_cross_entropy")),
                                      tokens=cfg.data.seq_len // t.sequence_parallel, causal_lm=m.task == "causal_lm",
                                      moe=moe.is_moe(model_config))
    text = text_config(model_config)
    micro = t.micro_batch_size
    offloading = _activation_offload(cfg, text, hidden_size(text), micro, machine)
    ranks = world // t.sequence_parallel
    groups = f"{ranks} sequence-parallel groups" if t.sequence_parallel > 1 else f"{ranks} rank{'s' * (ranks > 1)}"
    what = {"sft": "sequences", "grpo": f"prompts (x {cfg.rl.num_generations} completions)",
            "kto": "unpaired rows (each with a mismatched completion: twice the sequences)"}.get(
        t.objective, "pairs (chosen and rejected: twice the sequences)")
    batch_why = (f"micro {micro} x grad_accum {t.grad_accum} x {groups} = {micro * t.grad_accum * ranks} {what} "
                 f"of {cfg.data.seq_len:,} tokens; {total_steps if total_steps is not None else 'one epoch of'} steps")
    return Resolved(world, stage, precision[0], precision[1], fp8, adapter_autocast, micro, t.grad_accum, batch_why,
                    total_steps, packed, packing_why, attn, compiled, compile_why, compile_note,
                    leaves, leaves_why, tiled, tiled_why,
                    loss_on, loss_why, tiled_loss_tile(model_config.vocab_size), liger, experts, offloading, machine,
                    *_objective(cfg), *_optimizer(cfg, ds, stage),
                    deepspeed_defaults=ds_defaults.effective(ds, t.collective_timeout_s),
                    hub=[h.to_dict() for h in hub.resolved()])


def _optimizer(cfg: Config, ds: dict[str, Any], stage: int) -> tuple[str, bool]:
    """(what steps the weights (the DeepSpeed config's optimizer section, filled), in what dtype, rounded and clipped
    how; whether torchao's stochastic-rounding AdamW takes the place of DeepSpeed's)."""
    from toolkit.config import optimizers as opt
    from toolkit.runtime.low_precision import stochastic

    params = (ds.get("optimizer") or {}).get("params") or {}
    typ = (ds.get("optimizer") or {}).get("type", "none (a client optimizer)")
    if opt.is_muon(ds):
        what = (f"Muon: 2-D hidden matrices at lr {params.get('muon_lr', params.get('lr'))}, momentum "
                f"{params.get('momentum', opt.MUON_MOMENTUM)}; embeddings, head, norms and biases to its Adam at lr "
                f"{params.get('adam_lr', params.get('lr'))}")
    else:
        what = f"{typ} at lr {params.get('lr')}"
    sr = stochastic(cfg.train.bf16_rounding, ds)
    if sr:
        what += " (torchao's, rounding stochastically into the bf16 masters)"
    elif opt.states_of(ds) == "bf16":
        what += f" (rounding to nearest: {opt.stochastic_rounding_blocker(ds) or 'train.bf16_rounding=nearest'})"
    states = ("bf16 master weights, gradients and states" if opt.states_of(ds) == "bf16" else
              "bf16 master weights and gradients, fp32 states" if opt.master_bf16(ds) else
              "fp32 master weights and states")
    clip = cfg.train.grad_clip
    clip_why = (f"gradient clipping at {clip}" if clip else
                f"no gradient clipping (DeepSpeed would clip Muon's update at ZeRO-{stage})"
                if opt.clips_muon_update(ds, stage) else "no gradient clipping (Muon's default)" if opt.is_muon(ds)
                else "no gradient clipping")
    return f"{what}; {states}; {clip_why}", sr


def _objective(cfg: Config) -> tuple[str, str | None, str]:
    """(objective, reference mode or None, why): what a preference or RL run optimizes and against what."""
    from toolkit.runtime.objectives.losses import REFERENCE_FREE
    from toolkit.runtime.objectives.reference import mode_of

    t, pref = cfg.train, cfg.pref
    if t.objective == "sft":
        return "sft", None, "next-token loss"
    rl = cfg.rl
    knobs = {"dpo": f"beta {pref.beta}, label_smoothing {pref.label_smoothing}", "ipo": f"beta {pref.beta}",
             "simpo": f"beta {pref.beta}, gamma {pref.simpo_gamma}", "orpo": f"lambda (pref.beta) {pref.beta}",
             "kto": f"beta {pref.beta}, desirable_weight {pref.desirable_weight}, undesirable_weight "
                    f"{pref.undesirable_weight}",
             "reward": f"Bradley-Terry, center_rewards_coefficient {pref.center_rewards_coefficient}",
             "grpo": f"{rl.num_generations} completions a prompt of up to {rl.max_completion_length} tokens, "
                     f"temperature {rl.temperature}, loss_type {rl.loss_type}, scale_rewards {rl.scale_rewards}, "
                     f"epsilon {rl.epsilon}{f'/{rl.epsilon_high}' if rl.epsilon_high else ''}, beta {rl.beta}"}
    what = f"{t.objective} ({knobs[t.objective]})"
    if t.objective in REFERENCE_FREE:
        return t.objective, None, f"{what}, reference-free"
    if t.objective == "grpo" and not rl.beta:
        return t.objective, None, f"{what}; no reference (rl.beta=0)"
    mode, why = mode_of(pref.reference, bool(cfg.lora.enabled))
    where = ", its parameters on the CPU" if mode == "engine" and pref.reference_offload else ""
    return t.objective, mode, f"{what}; reference: {mode} ({why}{where})"


def _activation_offload(cfg: Config, text: Any, hidden: int, micro: int, machine: Machine) -> OffloadPlan:
    """model.activation_offload: one micro-batch's tokens on a rank against its GPU, then pinned or pageable host
    buffers against its host (speedups.activation_offload_on / offload_pinned, which `toolkit plan` also uses)."""
    from toolkit.plan.speedups import activation_offload_on, offload_pinned

    setting = cfg.model.activation_offload
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    tokens = micro * cfg.data.seq_len // cfg.train.sequence_parallel
    on, why = activation_offload_on(setting, grad_ckpt=cfg.model.gradient_checkpointing, cuda=machine.cuda,
                                    layers=layers, hidden=hidden, tokens=tokens, gpu_bytes=machine.gpu_bytes)
    if not on:
        return OffloadPlan(False, why)
    pinned, pinned_why = offload_pinned(layers=layers, layer_bytes=2.0 * hidden * tokens,
                                        ranks_per_node=machine.ranks_per_node, host_bytes=machine.host_bytes,
                                        setting=setting)
    return OffloadPlan(True, why, pinned, pinned_why, layers)


def saved_changes(run_dir: Any, now: Resolved) -> list[str]:
    """A resumed run's record against the one its run dir holds: the differences, [] when none or none saved."""
    import json
    from pathlib import Path

    path = Path(run_dir) / RECORD
    with contextlib.suppress(OSError, ValueError):
        return changes(json.loads(path.read_text()), json.loads(json.dumps(now.to_dict())))
    return []
