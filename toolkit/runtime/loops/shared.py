"""What both paths call the same way: the metrics logger, the held-out evaluator, and the checks after the engine
exists and after the first step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from toolkit.launch import dist
from toolkit.observe.memory import MemoryMonitor
from toolkit.observe.metrics import (
    MetricsLogger,
    TokenCounter,
    attention_width,
    count_params,
    flops_per_token,
    peak_flops_per_gpu,
)
from toolkit.runtime.data.batches import Collator, Rows
from toolkit.runtime.loops.evaluate import evaluate
from toolkit.runtime.loops.state import Evaluator
from toolkit.runtime.model import check_first_loss, check_zero3_leaves, is_preset
from toolkit.runtime.moe import autoep

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


def evaluator(p: RunSpec, rows: Rows | None, collate: Collator, metrics: MetricsLogger, sp: Any = None,
              generate: Callable[[Any, int, bool], None] | None = None, pref: Any = None) -> Evaluator | None:
    """eval(engine, step, final): the held-out loss every train.eval_every steps and at the end, and generation
    every eval.generate_every steps (the final generation comes after training, in loops/run.py); None when
    neither is asked for. Every rank calls it (ZeRO-3 forwards are collectives). pref: a preference run's step,
    which evaluates its held-out pairs (objectives/step.py)."""
    every, gen_every = p.cfg.train.eval_every, p.cfg.eval.generate_every if generate is not None else 0
    if rows is None and not gen_every:
        return None

    def run(engine: Any, step: int, final: bool) -> None:
        if rows is not None and (final or (every and step % every == 0 and step < p.total_steps)):
            micro = p.cfg.train.micro_batch_size
            metrics.log_eval(step, pref.evaluate(engine, rows, micro) if pref is not None else
                             evaluate(engine, rows, collate, micro, p.cfg.model.task, sp))
        if generate is not None and gen_every and not final and step % gen_every == 0 and step < p.total_steps:
            generate(engine, step, False)

    return run


def metrics_logger(p: RunSpec, model: Any) -> MetricsLogger:
    """MFU needs FLOPs per token (counted on the built model: ZeRO-3 shards report their full size)
    and the GPU's peak, known for bf16/fp16 on the GPUs in metrics.GPU_PEAK_TFLOPS or from
    metrics.peak_tflops; otherwise the lines carry mfu=null."""
    total, trainable = count_params(model)
    mc = p.model_config
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", None)
    if layers is None:
        # stacks of their own widths, none the config's own (BLT): the trained stacks' layers the model built (not a
        # patcher, frozen or not built), at the widest one's width (attention_width), an upper bound on their
        # attention; MFU only
        from toolkit.plan.trace import stack_configs, trained_stacks

        # under LoRA nothing of a stack trains: then every stack its config counts
        layers = sum(len(stack) for _, stack in trained_stacks(model)) or sum(
            int(getattr(mc, k).num_hidden_layers) for k in stack_configs(mc))
    fpt = flops_per_token(total, trainable, int(layers), attention_width(mc), p.cfg.data.seq_len)
    name = None if dist.on_cpu() else torch.cuda.get_device_name(dist.local_rank())
    peak = peak_flops_per_gpu(name, p.precision, p.cfg.metrics.peak_tflops)
    return MetricsLogger(p.run_dir, p.total_steps, TokenCounter(), flops_per_token=fpt,
                         peak_flops=None if peak is None else peak * p.world_size,
                         tensorboard=p.cfg.metrics.tensorboard, report_to=tuple(p.cfg.metrics.report_to),
                         run_config=p.cfg.to_dict())


def first_step(p: RunSpec, step: int, loss: float, mem: MemoryMonitor) -> None:
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


FIRST_LOSS_ROUNDING = 0.05
"""How far (relative, at least 1) a preference run's first loss may sit from its policy = reference value in bf16/fp16
before the run stops: rounding moves it by about a hundredth, another model or kernel by about a tenth."""


def first_loss_check(p: RunSpec, loss: float) -> None:
    t = p.cfg.train
    if t.objective != "sft":
        from toolkit.runtime.objectives.step import first_loss

        pref = p.cfg.pref
        want = first_loss(t.objective, pref.beta, pref.desirable_weight, pref.undesirable_weight)
        if want is None:
            return
        off = abs(loss - want) / max(1.0, want)
        # In bf16 a reference run by other code than the policy's (a ZeRO-3 engine beside a ZeRO-2 policy) differs by
        # rounding: 0.7021 against ln 2 on llama-1b, short pairs, one H200. Other weights or kernels move it further
        # (0.784 with Liger's kernels in the policy only): those stop the run; rounding is said and trains on.
        stop = 1e-3 if p.precision == "fp32" else FIRST_LOSS_ROUNDING
        if off > stop:
            raise RuntimeError(f"train.objective={t.objective}: the first step's loss is {loss:.6f}, not {want:.6f} as "
                               "it is when the policy is its own reference: the reference model is not the policy's "
                               "starting point (other weights, dropout, other kernels, or another precision)")
        if off > 1e-3 and dist.rank() == 0:
            print(f"train.objective={t.objective}: the first step's loss is {loss:.6f} against {want:.6f} (policy = "
                  f"reference): {p.precision} rounding between the reference's code and the policy's", flush=True)
        return
    msg = check_first_loss(loss, p.model_config.vocab_size, p.cfg.model.task, not is_preset(p.cfg.model.name))
    if msg:
        raise RuntimeError(msg)
