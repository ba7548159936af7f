"""The raw path: `deepspeed.initialize` and a loop whose step reads as its parts: batch, forward and loss, backward,
optimizer step, observe, evaluate, checkpoint.

Nothing in the loop waits for the GPU except on log steps: the label count is reduced on the device, the loss
accumulates there, and host values (loss, grad norm) are read only to log.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from toolkit.launch import dist
from toolkit.observe import breakdown
from toolkit.observe.memory import MemoryMonitor
from toolkit.observe.metrics import MetricsLogger
from toolkit.runtime import low_precision, moe, optimizer_groups
from toolkit.runtime.data.batches import (
    Collator,
    EpochOrder,
    ListDataset,
    ShardedBatches,
    to_device,
    window_repeats,
)
from toolkit.runtime.faults import fp32_kept, resume, watchdog
from toolkit.runtime.faults.checkpoint import save_deepspeed_checkpoint
from toolkit.runtime.faults.guards import NonFiniteGuard
from toolkit.runtime.faults.moved import MoveCheck
from toolkit.runtime.loops.evaluate import target_count
from toolkit.runtime.loops.shared import autoep_check, first_step, leaf_check
from toolkit.runtime.loops.state import RunState
from toolkit.runtime.sequence import offload, ulysses

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


@dataclass
class Window:
    """One optimizer step's micro-batches on this rank, and what the step accumulated on the device."""

    batches: list[dict[str, torch.Tensor]]
    samples: list[int]
    loss: torch.Tensor
    aux: torch.Tensor

    def again(self) -> Window:
        """The same micro-batches for another step (a GRPO rollout's next update), its sums at zero."""
        return Window(self.batches, self.samples, torch.zeros_like(self.loss), torch.zeros_like(self.aux))


def lr_schedule(p: RunSpec) -> Any:
    """The warmup + cosine schedule, transformers' own function (the Trainer path uses the same)."""
    from transformers import get_cosine_schedule_with_warmup

    total, warmup = p.total_steps, p.cfg.train.warmup_steps
    return lambda optimizer: get_cosine_schedule_with_warmup(optimizer, warmup, total)


def loader_kwargs() -> dict[str, Any]:
    """Batches prepared ahead of the step: a collating worker and pinned memory on GPUs. On CPU the
    ranks already share the cores, and a worker per rank would only compete with them."""
    if dist.on_cpu():
        return {}
    return {"num_workers": 2, "pin_memory": True, "prefetch_factor": 4, "persistent_workers": True}


def _micro_batches(loader: torch.utils.data.DataLoader, sampler: ShardedBatches, epoch: int) -> Iterator[Any]:
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _label_count(batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Predicted tokens in the accumulation window on all ranks (labels shift by one), summed on the
    device: the forward waits for it on the stream, the host does not."""
    local = sum(target_count(b) for b in batches)
    return dist.all_reduce_tensor(torch.as_tensor(local, dtype=torch.int64).to(device, non_blocking=True))


class RawLoop:
    """One run of the raw path; `train()` returns (engine, last step, stopped early)."""

    def __init__(self, p: RunSpec, model: Any, dataset: ListDataset, collator: Collator, order: EpochOrder,
                 metrics: MetricsLogger, mem: MemoryMonitor, state: RunState) -> None:
        self.p, self.t, self.metrics, self.mem, self.state = p, p.cfg.train, metrics, mem, state
        sp = state.sp
        # under sequence parallelism the ranks of a group draw the same batches and each keeps its slice
        self.data_rank, self.data_world = (sp.dp_rank, sp.dp_world) if sp else (dist.rank(), p.world_size)
        self.loss_mult = ulysses.loss_multiplier(sp, p.ds) if sp else p.world_size
        self.causal = p.cfg.model.task == "causal_lm"
        self.device = dist.device()
        experts = moe.experts_of(model) if state.aux_coef else None
        self.load = moe.ExpertLoad(experts.top_k) if experts else None
        self.model, self.dataset, self.collator, self.order = model, dataset, collator, order
        self.repeats = window_repeats(p.cfg)

    # ------------------------------------------------------------------ setup

    def _engine(self) -> tuple[Any, Any, int]:
        """(engine, scheduler, the step to start from): initialize, checks, and a resume's checkpoint loaded."""
        import deepspeed

        p, t, sp = self.p, self.t, self.state.sp
        params = [q for q in self.model.parameters() if q.requires_grad]
        universal = resume.prepare(p.reshard, t.collective_timeout_s)  # another rank count: convert first
        ds, client = low_precision.engine_config(p.ds, p.resolved.stochastic_rounding)
        engine, _, _, scheduler = deepspeed.initialize(model=self.model, model_parameters=params, config=ds,
                                                       optimizer=client, lr_scheduler=lr_schedule(p),
                                                       mpu=sp.mpu if sp else None)
        low_precision.share_masters(engine.optimizer)
        leaf_check(engine.module)
        autoep_check(p, engine.module)
        optimizer_groups.record(p.run_dir, engine.module)
        fp32_kept.check(p.run_dir, engine.module, ds, p.precision)
        step = 0
        if p.resume_from:
            ck = p.resume_from
            # A 4-bit base's state dict carries bitsandbytes' quantization state (absmax, quant_map, ...), which
            # load_state_dict cannot take back (transformers rebuilds it while loading, from_prequantized). The base
            # is rebuilt and quantized again as at the start, identically; the adapters and their states come from
            # the checkpoint, and resume.verify's fixed-batch loss would catch any that did not. The HF Trainer
            # loads PEFT models unstrict for the same reason.
            path, client = engine.load_checkpoint(str(ck.tag_dir.parent), tag=universal or ck.tag_dir.name,
                                                  load_module_strict=not p.cfg.model.load_in_4bit)
            if path is None:
                raise FileNotFoundError(f"train.resume={t.resume}: DeepSpeed could not load {ck.tag_dir}")
            step = int(client["step"])
            resume.verify(engine, self.state.fixed_batch, ck, p.run_dir, p.precision, p.world_size, t.grad_accum,
                          universal)
        return engine, scheduler, step

    def _stream(self, step: int) -> tuple[Iterator[Any], ShardedBatches]:
        t = self.t
        sampler = ShardedBatches(self.order, t.micro_batch_size, self.data_rank, self.data_world)
        per_epoch = len(sampler)  # micro-batches per rank per epoch, a multiple of grad_accum
        consumed = step // self.repeats * t.grad_accum  # a window repeated (GRPO's mu) is drawn once
        sampler.skip = consumed % per_epoch
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collator,
                                             **loader_kwargs())
        return _micro_batches(loader, sampler, consumed // per_epoch), sampler

    # ------------------------------------------------------------------ the parts of a step

    def batch(self, stream: Iterator[Any], sampler: ShardedBatches) -> Window:
        """The window's micro-batches, counted (host tensors: free) and, under sequence parallelism, sliced."""
        sp = self.state.sp
        batches = [next(stream) for _ in range(self.t.grad_accum)]
        samples = [i for _ in batches for i in sampler.drawn.popleft()]
        for b in batches if not sp or sp.rank == 0 else []:  # a group's batches are counted once
            if "input_ids" in b:  # an RL step's prompts: it counts the sequences it trains on itself
                self.metrics.counter.add(b)
        if sp:
            batches = [sp.shard(b) for b in batches]
        zero = torch.zeros((), device=self.device)
        return Window(batches, samples, zero, zero.clone())

    def forward_backward(self, engine: Any, w: Window) -> None:
        """Forward, loss and backward of each micro-batch; DeepSpeed's engine.step() after each applies the
        optimizer at the window's end."""
        t, aux_coef = self.t, self.state.aux_coef
        if self.state.pref is not None:  # a preference objective: pairs, a reference, its own loss
            self.state.pref.forward_backward(engine, w.batches, w.loss)
            return
        aux_kwargs = {"output_router_logits": True} if aux_coef else {}
        n_items = _label_count(w.batches, self.device) if self.causal else None
        offloading = self.p.resolved.activation_offload
        for b in w.batches:
            b = to_device(b, self.device)
            with offload.context(offloading):  # forward and backward of one micro-batch
                if self.causal:
                    # Token-level mean over the whole accumulation window and all ranks, the same
                    # normalization the HF Trainer uses (model returns sum/n_items; DeepSpeed then
                    # averages over ranks, hence x world; no extra 1/grad_accum). Under sequence parallelism
                    # see ulysses.loss_multiplier.
                    out = engine(**b, num_items_in_batch=n_items, **aux_kwargs)
                    aux = moe.aux_term(out, aux_coef, t.grad_accum)
                    loss = out.loss * self.loss_mult + aux
                    if self.load is not None:
                        self.load.add(getattr(out, "router_logits", None))
                    # the output holds the bf16 logits ([tokens, vocabulary], 2 bytes a logit) that nothing in
                    # backward needs: kept, they stayed alive through it (GPT-2 micro 16: 1.5 GiB of a 21.2 peak)
                    del out
                    engine.backward(loss, scale_wrt_gas=False)
                    w.loss += loss.detach()
                    if isinstance(aux, torch.Tensor):
                        w.aux += aux.detach() / aux_coef
                else:
                    loss = engine(**b).loss
                    engine.backward(loss)
                    w.loss += loss.detach() / t.grad_accum
            engine.step()

    def observe(self, engine: Any, scheduler: Any, step: int, last: int, w: Window, guard: NonFiniteGuard) -> bool:
        """The guard, and on log steps the metrics line (a host sync); returns whether this was a log step."""
        t, state = self.t, self.state
        grad_norm = engine.get_global_grad_norm()  # often a device tensor: read on log steps only
        guard.observe(step, w.loss, grad_norm, w.samples, engine.skipped_steps)
        logged = step % t.log_every == 0 or step == last or step == 1
        if logged:
            extra = None
            if state.aux_coef:  # the load-balancing loss alone, the mean over micro-batches and ranks (a collective)
                extra = {"moe_aux_loss": float(dist.all_reduce_tensor(w.aux)) / self.p.world_size}
                if self.load is not None:  # per MoE layer: the busiest expert's tokens / the mean, over the window
                    extra["expert_load"] = self.load.take()
            if state.pref is not None:  # rewards, margins, accuracy: means over the window and ranks (a collective)
                extra = {**(extra or {}), **state.pref.take()}
            rec = self.metrics.log(step, float(w.loss), scheduler.get_last_lr()[0],
                                   None if grad_norm is None else float(grad_norm), loss_scale=1 / self.loss_mult,
                                   extra=extra)
            guard.check()
            if step == 1:
                first_step(self.p, step, rec["loss"], self.mem)
        if not state.breakdown_done:  # after this process's first optimizer step: states exist
            breakdown.record(self.p.run_dir, dist.rank(), engine, step)
            state.breakdown_done = True
        if step > 1:
            self.mem.maybe_step(step)
        return logged

    def checkpoint(self, engine: Any, step: int, last: int, logged: bool) -> bool:
        """A save at train.save_every, at train.stop_after, or on an agreed SIGTERM; returns whether to stop here."""
        t, state, p = self.t, self.state, self.p
        saving = bool((t.save_every and step % t.save_every == 0) or
                      (t.stop_after and step == last and step < p.total_steps))
        preempted = logged and step < last and state.preempt.agreed()  # SIGTERM: stop here, with a checkpoint
        if saving or preempted:
            state.phase = "save"  # what status.json says if the save fails
            global_batch = t.micro_batch_size * t.grad_accum * self.data_world
            save_deepspeed_checkpoint(engine, p.run_dir / "checkpoints", step, t.keep_checkpoints,
                                      lambda: resume.save_record(engine, state.fixed_batch, p.world_size,
                                                                 global_batch, t.sequence_parallel))
            state.phase = "train"
        state.preempted = bool(preempted)
        return bool(preempted)

    # ------------------------------------------------------------------ the loop

    def train(self) -> tuple[Any, int, bool]:
        p, t, state = self.p, self.t, self.state
        engine, scheduler, step = self._engine()
        if state.pref is not None:  # a precomputed reference: its values before the first step (loaded on a resume)
            state.pref.prepare(engine, self.dataset.rows, self.collator,
                               ShardedBatches(self.order, t.micro_batch_size, self.data_rank, self.data_world),
                               resumed=step > 0)
        self.mem.phase_boundary("engine_ready", step)
        stream, sampler = self._stream(step)
        self.metrics.start(step)
        state.phase = "train"
        last = min(p.total_steps, t.stop_after) if t.stop_after else p.total_steps
        guard = NonFiniteGuard(self.device, dist.rank(), p.precision == "fp16", t.max_skipped_steps)
        moved = MoveCheck(engine.module, t.check_moved)
        engine.train()
        state.profiler.step_done(step)  # a window that includes step + 1 (1, or the resumed step + 1) opens here
        window: Window | None = None
        while step < last:
            watchdog.step_begin(step + 1)  # the hang deadline covers the step, not the save or eval after it
            # a new window each step, or each rl.num_iterations steps (a resume inside them draws its window again)
            window = self.batch(stream, sampler) if window is None or step % self.repeats == 0 else window.again()
            moved.step_begin(engine)
            self.forward_backward(engine, window)
            step += 1
            state.step = step
            line = moved.step_end(engine, step)
            if line and dist.rank() == 0:
                tqdm.write(line)  # through the progress bar: the line starts a line of its own
            logged = self.observe(engine, scheduler, step, last, window, guard)
            watchdog.step_end()
            if state.evaluate:
                state.evaluate(engine, step, False)
            if self.checkpoint(engine, step, last, logged):
                break
            state.profiler.step_done(step)
        if state.evaluate and step >= p.total_steps:
            state.evaluate(engine, step, True)
        self.metrics.close()  # the bar ends before export and the summary print
        return engine, step, step < p.total_steps
