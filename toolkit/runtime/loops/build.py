"""The model as the record says: built under the live DeepSpeed config, then Liger, the tiled loss, ZeRO-3 leaves,
AutoEP, tiled MLPs, sequence parallelism, float8 and compile applied in that order (both paths), before
deepspeed.initialize. Every rank applies the same record; rank 0 says what was done."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.launch import dist
from toolkit.observe.metrics import attention_width, count_params, flops_per_token
from toolkit.runtime import moe
from toolkit.runtime.model import build_model, hidden_size
from toolkit.runtime.moe import autoep
from toolkit.runtime.sequence import tiling, ulysses
from toolkit.runtime.speed import compile as compiling
from toolkit.runtime.speed import fp8, kernels

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec

FP8_ZERO3_NOTE = ("note: here the decoder layers cannot be ZeRO-3 leaf modules (frozen input embeddings, or NVMe "
                  "parameter offload), so "
                  "DeepSpeed's hooks split each compiled layer into a graph per Linear and the float8 casts do not fuse "
                  "(llama-1b on one H200: 51.6k tokens/s against 80.2k at ZeRO-2; bench/results/fp8_compile.md)")


@dataclass
class Built:
    model: Any
    aux_coef: float
    """The load-balancing loss weight the model's loss no longer carries (moe.take_aux_loss), 0 for none."""
    sp: Any
    """Sequence parallelism's handle (sequence/ulysses.py), None without it."""


def build(p: RunSpec) -> Built:
    """Call after the DeepSpeed config object is alive (ZeRO-3 partitions the model at construction)."""
    r, cfg, rank = p.resolved, p.cfg, dist.rank()
    if r.experts is not None and r.experts.implementation:  # read by the experts modules at every forward
        p.model_config._experts_implementation = r.experts.implementation
    model = build_model(cfg, p.model_config, frozen_bf16=r.adapter_autocast, attn=r.attention.implementation,
                        precision=p.precision)
    _say_load_report(p, model)
    kernels.apply(model, r.liger)
    _tile_loss(p, model)
    if r.stage == 3:
        moe.set_leaves(model)  # blocks with one module per expert: leaves, or ZeRO-3 hangs when ranks route apart
    experts = moe.describe(model, p.ds, liger=bool(r.experts and r.experts.liger))
    aux_coef = moe.take_aux_loss(model, cfg.moe.aux_loss_coef)
    if experts and rank == 0:
        print(f"{experts}; load-balancing loss x {aux_coef:g} (moe.aux_loss_coef={cfg.moe.aux_loss_coef})", flush=True)
    if autoep.enabled(p.ds):  # every rank: the registry fix must exist in each process before deepspeed.initialize
        found = moe.experts_of(model)
        line = autoep.prepare(p.ds, found.count if found else 0)
        if rank == 0:
            print(line, flush=True)
    if r.tiled_mlp:
        layers = compiling.decoder_layers(model)
        tiled = tiling.tile_mlps(layers, cfg.model.tiled_mlp_shards)
        if tiled < len(layers) and rank == 0:
            print(f"MLP tiling: {tiled} of {len(layers)} layers (Mixture-of-Experts blocks are not tiled)", flush=True)
    sp = ulysses.start(cfg.train.sequence_parallel, p.model_config, cfg.train.micro_batch_size) \
        if cfg.train.sequence_parallel > 1 else None
    _fp8_and_compile(p, model)
    return Built(model, aux_coef, sp)


def _say_load_report(p: RunSpec, model: Any) -> None:
    """Rank 0: the checkpoint's line, and load_report.json in the run dir (what was expected, and why)."""
    report = getattr(model, "toolkit_load_report", None)
    if report is None or dist.rank() != 0:
        return
    import json

    from toolkit.runtime.faults.checkpoint import atomic_write

    print(report.line(), flush=True)
    atomic_write(p.run_dir / "load_report.json", json.dumps(report.to_dict(), indent=1) + "\n")


def _tile_loss(p: RunSpec, model: Any) -> None:
    """model.tiled_loss as resolved (toolkit/runtime/sequence/tiling.py tile_loss), after Liger."""
    r = p.resolved
    if not r.tiled_loss:
        return
    if not tiling.tile_loss(model, r.tiled_loss_tile):
        if p.cfg.model.tiled_loss == "true":
            raise ValueError(f"model.tiled_loss=true: {type(model).__name__} has no decoder and output embeddings "
                             "to tile its loss over; set model.tiled_loss=auto or false")
        if dist.rank() == 0:  # auto: such a model keeps its plain loss
            print(f"logits and loss tiled over the sequence: off ({type(model).__name__} has no decoder and output "
                  "embeddings to tile)", flush=True)


def _fp8_and_compile(p: RunSpec, model: Any) -> None:
    """After LoRA and Liger, before deepspeed.initialize (both paths): float8 Linears first, so the compiled
    graph is the float8 one, then each decoder layer compiled in place (toolkit/runtime/speed/compile.py)."""
    r = p.resolved
    layers = compiling.decoder_layers(model)
    lines = []
    if not r.fp8 and r.machine.cuda and not p.cfg.lora.enabled and p.cfg.model.task == "causal_lm" \
            and dist.rank() == 0:
        total, trainable = count_params(model)
        mc = p.model_config
        fpt = flops_per_token(total, trainable, len(layers), attention_width(mc), p.cfg.data.seq_len)
        lines.append(fp8.hint(layers, fpt, hidden_size(mc), dist.local_rank()) or "")
    if r.fp8:
        lines.append(fp8.describe(fp8.convert(model, layers, r.fp8), r.fp8, len(layers)))
    if r.compile:
        n, leaves = compiling.compile_layers(model, zero3_leaves=r.zero3_leaves)
        lines.append(compiling.describe(n, layers[0], r.compile_why, leaves))
        if r.fp8 and r.stage == 3 and not leaves:
            lines.append(FP8_ZERO3_NOTE)
    elif r.zero3_leaves:
        lines.append(compiling.eager_leaves(model, layers, r.zero3_leaves_why, p.cfg.train.zero3_leaves == "true"))
    if dist.rank() == 0 and any(lines):
        print("\n".join(x for x in lines if x), flush=True)
