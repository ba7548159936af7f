"""The HF Trainer path: transformers' Trainer on the same batches, loss normalization, schedule and DeepSpeed dict as
the raw loop (loops/raw.py), with the toolkit's records through its callbacks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from toolkit.launch import dist
from toolkit.observe import breakdown
from toolkit.observe.memory import MemoryCallback, MemoryMonitor
from toolkit.observe.metrics import MetricsLogger
from toolkit.runtime import low_precision, moe, optimizer_groups
from toolkit.runtime.data.batches import Collator, EpochOrder, ListDataset, ShardedBatches, steps_per_epoch
from toolkit.runtime.faults import fp32_kept, integrity, resume, watchdog
from toolkit.runtime.faults.checkpoint import begin_save, end_save, mark_complete
from toolkit.runtime.faults.guards import NonFiniteError
from toolkit.runtime.faults.moved import MoveCheck
from toolkit.runtime.loops.raw import loader_kwargs
from toolkit.runtime.loops.shared import autoep_check, first_loss_check, leaf_check
from toolkit.runtime.loops.state import RunState
from toolkit.runtime.sequence import offload, ulysses

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


def training_args(p: RunSpec) -> Any:
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
        remove_unused_columns=False, deepspeed=low_precision.engine_config(p.ds, p.resolved.stochastic_rounding)[0],
        use_cpu=dist.on_cpu(), ddp_timeout=t.collective_timeout_s,
        # train.compile compiles the decoder layers before the Trainer exists (loops/build.py); the
        # Trainer's own torch_compile would compile the whole engine again (and turn TF32 on globally)
        torch_compile=False,
        **{f"dataloader_{k}": v for k, v in loader_kwargs().items()},
        # accelerate copies batches with non_blocking=False by default: a wait per copy
        accelerator_config={"non_blocking": bool(loader_kwargs().get("pin_memory"))},
    )



def run_trainer(p: RunSpec, args: Any, model: Any, dataset: ListDataset, collator: Collator,
                 order: EpochOrder, metrics: MetricsLogger, mem: MemoryMonitor,
                 state: RunState) -> tuple[Any, int, bool]:
    from transformers import PrinterCallback, Trainer, TrainerCallback

    t = p.cfg.train
    counter = metrics.counter
    sp = state.sp
    pref = state.pref
    global_batch = t.micro_batch_size * t.grad_accum * p.world_size // t.sequence_parallel
    universal: str | None = None
    aux_coef = state.aux_coef
    offloading = p.resolved.activation_offload
    sampler: Any = ulysses.GroupOrder(order, t.micro_batch_size, sp.size) if sp else order
    per_epoch = steps_per_epoch(len(dataset), p.cfg, p.data_world)
    if sp:  # each rank trains on its slice of its group's micro-batch (sequence/ulysses.py)
        collator = ulysses.ShardingCollator(collator, sp)

    client = low_precision.engine_config(p.ds, p.resolved.stochastic_rounding)[1]

    class ToolkitTrainer(Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return sampler  # the raw loop deals the same order to the same ranks

        def create_optimizer(self, model: Any = None) -> Any:
            if client is None:
                return super().create_optimizer(model)
            # torchao's stochastic-rounding AdamW in place of DeepSpeed's (its config section is gone), on one group
            # of every trained parameter as the raw path gives DeepSpeed
            if self.optimizer is None:
                self.optimizer = client([q for q in self.model.parameters() if q.requires_grad])
            return self.optimizer

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
            if pref is not None:  # a preference objective: the mean over the micro-batch's pairs (objectives/step.py)
                loss = pref.loss(model, inputs)
                return (loss, None) if return_outputs else loss
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
            optimizer_groups.record(p.run_dir, trainer.model)
            fp32_kept.check(p.run_dir, trainer.model, p.ds, p.precision)
            low_precision.share_masters(trainer.model_wrapped.optimizer)
            integrity.install(trainer.model_wrapped)  # shards digested as they are written
            if pref is not None:  # a precomputed reference: its values before the first step (loaded on a resume)
                pref.prepare(trainer.model_wrapped, dataset.rows, collator,
                             ShardedBatches(order, t.micro_batch_size, dist.rank(), p.world_size),
                             resumed=p.resume_from is not None)
            if p.resume_from:  # the Trainer has loaded the checkpoint by now
                resume.verify(trainer.model_wrapped, state.fixed_batch, p.resume_from, p.run_dir, p.precision,
                              p.world_size, t.grad_accum, universal)
            state.moved = MoveCheck(trainer.model, t.check_moved)  # the engine's module, as the raw loop checks it
            state.phase = "train"
            metrics.start(st.global_step)
            state.profiler.step_done(st.global_step)  # a window that includes the first step opens here

        def on_epoch_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # The Trainer calls set_epoch on its loader after wrapping it to skip a resumed epoch's consumed batches
            # (transformers 5.24 _run_epoch, accelerate's SkipBatchSampler): that wrapper does not pass it on, so a
            # resumed epoch past the first would replay epoch 0's order. Set here, before the epoch's iterator exists.
            sampler.set_epoch(st.global_step // per_epoch)

        def on_step_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            watchdog.step_begin(st.global_step + 1)  # the hang deadline covers the step, not the save after it
            state.moved.step_begin(trainer.model_wrapped)

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> Any:
            watchdog.step_end()
            state.step = st.global_step
            line = state.moved.step_end(trainer.model_wrapped, st.global_step)
            if line and dist.rank() == 0:
                tqdm.write(line)  # through the progress bar: the line starts a line of its own
            state.profiler.step_done(st.global_step)
            if not state.breakdown_done:  # after this process's first optimizer step: states exist
                breakdown.record(p.run_dir, dist.rank(), trainer.model_wrapped, st.global_step)
                state.breakdown_done = True
            if state.evaluate:
                state.evaluate(trainer.model_wrapped, st.global_step, False)
            if t.stop_after and st.global_step >= t.stop_after:
                control.should_save = True
                control.should_training_stop = True
            elif (st.global_step % t.log_every == 0 and st.global_step < st.max_steps
                  and state.preempt.agreed()):  # SIGTERM: stop here, with a checkpoint
                control.should_save = True
                control.should_training_stop = True
                state.preempted = True
            if control.should_save:  # the Trainer saves right after this hook, into checkpoint-<step>
                state.pending_save = begin_save(trainer.model_wrapped, Path(args.output_dir) / f"checkpoint-{st.global_step}",
                                           "checkpoint-")
            return control

        def on_train_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # the end of the schedule, not a stop (train.stop_after, SIGTERM): the final held-out loss
            if state.evaluate and st.global_step >= st.max_steps and not state.preempted:
                state.evaluate(trainer.model_wrapped, st.global_step, True)

        def on_save(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            # Called on every rank once the Trainer's save returned; DeepSpeed's save ends with a
            # barrier, so every rank's shard is on disk. Resume only trusts marked checkpoints.
            ckpt = Path(args.output_dir) / f"checkpoint-{st.global_step}"
            # every rank ran on_step_end's begin_save (the Trainer saves only where should_save was set there)
            digests = end_save(state.pending_save, ckpt) if state.pending_save is not None else {}
            state.pending_save = None
            record = resume.save_record(trainer.model_wrapped, state.fixed_batch, p.world_size, global_batch,
                                        t.sequence_parallel)
            if dist.rank() == 0:
                mark_complete(ckpt, st.global_step, record | digests)

        def on_log(self, args: Any, st: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs:
                return
            metrics.log(st.global_step, float(logs["loss"]), float(logs.get("learning_rate", 0.0)),
                        logs.get("grad_norm"), extra=pref.take() if pref is not None else None)
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
    if pref is not None:
        # the preference loss is a mean over the micro-batch's pairs, not normalized by num_items_in_batch: the
        # Trainer then divides it by the accumulation steps, as the raw loop's engine.backward does (declared as
        # for seq_cls below: every transformers 5.x reads it)
        trainer.model_accepts_loss_kwargs = False
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
    stopped = bool(t.stop_after and step >= t.stop_after and step < p.total_steps) or state.preempted
    return trainer.model_wrapped, step, stopped


