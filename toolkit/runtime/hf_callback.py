"""The toolkit inside someone else's HF Trainer script: one `TrainerCallback` (`from toolkit import
ToolkitCallback`) that gives a plain `Trainer` what toolkit/train.py gives its own runs:

- per-rank memory in RUN_DIR/memory/rank{N}.jsonl and the cross-rank table at engine start, first step
  and end (toolkit/observe/memory.py's MemoryMonitor and MemoryCallback, unchanged);
- the NaN/Inf stop: a non-finite loss or gradient norm on a log step raises NonFiniteError on every
  rank (the logged values are global), instead of training on from garbage;
- a run directory `toolkit report RUN_DIR` reads: metrics.jsonl (loss, lr, grad norm, samples/s, and
  tokens/s and MFU where the Trainer counts tokens), config.yaml (what the Trainer was told),
  ds_config.json (the DeepSpeed dict as DeepSpeed got it, no "auto" left), versions.json, status.json.

Callbacks run on every rank, so the memory table's collective lines up; only rank 0 writes the shared
files. Nothing here changes what trains, except turning `logging_nan_inf_filter` off: with it on, the
Trainer logs the mean of the finite losses in place of a NaN and the stop would never see one.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist
from toolkit.observe.memory import MemoryCallback, MemoryMonitor
from toolkit.observe.metrics import (
    attention_width,
    closing_summary,
    count_params,
    flops_per_token,
    peak_flops_per_gpu,
)
from toolkit.runtime.faults.checkpoint import RUN_ENTRIES, holds_a_run, versions
from toolkit.runtime.faults.guards import NonFiniteError


def _precision(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _deepspeed_dict() -> dict[str, Any] | None:
    """The dict the Trainer handed to deepspeed.initialize: accelerate's DeepSpeed plugin holds it, with
    every "auto" filled (the one `transformers.integrations.deepspeed_config()` returns is an earlier
    copy that still has the hidden-size "auto" values). None without DeepSpeed."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return None
    plugin = getattr(AcceleratorState(), "deepspeed_plugin", None)
    cfg = getattr(plugin, "deepspeed_config", None)
    return dict(cfg) if isinstance(cfg, dict) else None


class ToolkitCallback(TrainerCallback):
    """Per-rank memory, the NaN/Inf stop and a `toolkit report` run directory for a plain HF Trainer.

    ``run_dir``: where the records go. A directory that already holds a run is refused unless the Trainer
    resumes (``train(resume_from_checkpoint=...)``: the records continue) or ``overwrite=True``.
    ``memory_every``: a memory snapshot every N optimizer steps on every rank (0: phases only).
    """

    def __init__(self, run_dir: str | Path, memory_every: int = 10, overwrite: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.memory_every = memory_every
        self.overwrite = overwrite
        self._memory: Any = None  # MemoryCallback, once the ranks are known (on_train_begin)
        self._rank, self._world = 0, 1
        self._history: list[dict[str, Any]] = []
        self._last: tuple[float, int, int] = (0.0, 0, 0)  # time, step, tokens seen at the previous log line
        self._t0 = 0.0
        self._model: Any = None
        dist.settle_at_exit()  # the script, not the toolkit, ends this process: see settle_at_exit

    # -- start ---------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        resumed = state.global_step > 0  # the Trainer has loaded its checkpoint by now
        self._rank, self._world = args.process_index, args.world_size
        error = None
        if self._rank == 0:
            try:
                self._claim(resumed)
                self._write_run_files(args, state, model)
            except (ConfigError, OSError) as e:
                error = str(e)
        dist.release_deepspeed_shm()  # the Trainer started the group: DeepSpeed's CPU files leak otherwise
        error = dist.broadcast_object(error)  # every rank stops, not only the one that saw it
        if error:
            raise ConfigError(error)
        if args.logging_nan_inf_filter:
            # the filter replaces a NaN/Inf loss with the mean of the finite ones: nothing to stop on
            args.logging_nan_inf_filter = False
        monitor = MemoryMonitor(self.run_dir, self._rank, self._world, args.local_process_index,
                                every=self.memory_every)
        self._memory = MemoryCallback(monitor)
        self._model = model
        self._t0 = time.perf_counter()
        self._last = (self._t0, state.global_step, state.num_input_tokens_seen)
        self._memory.on_train_begin(args, state, control)

    def _claim(self, resumed: bool) -> None:
        if resumed or not holds_a_run(self.run_dir):
            return
        if not self.overwrite:
            raise ConfigError(f"ToolkitCallback: {self.run_dir} already holds a run; give another run_dir, resume "
                              "the Trainer from its checkpoint, or pass overwrite=True")
        for e in self.run_dir.iterdir():
            if e.name in RUN_ENTRIES:  # only what a run writes; anything else in the directory stays
                shutil.rmtree(e) if e.is_dir() else e.unlink()

    def _write_run_files(self, args: Any, state: Any, model: Any) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "config", None)
        name = getattr(config, "_name_or_path", None) or getattr(config, "model_type", None) or type(model).__name__
        summary = {
            "model": {"name": name},
            "train": {"path": "hf-trainer", "precision": _precision(args),
                      "micro_batch_size": args.per_device_train_batch_size,
                      "grad_accum": args.gradient_accumulation_steps, "lr": args.learning_rate,
                      "max_steps": state.max_steps, "warmup_steps": args.warmup_steps, "seed": args.seed,
                      "output_dir": args.output_dir},
        }
        import yaml

        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(summary, sort_keys=False))
        ds = _deepspeed_dict()
        if ds is not None:
            (self.run_dir / "ds_config.json").write_text(json.dumps(ds, indent=2, default=str) + "\n")
        extra = {"world_size": self._world, "precision": _precision(args), "path": "hf-trainer"}
        (self.run_dir / "versions.json").write_text(json.dumps(versions() | extra, indent=2) + "\n")
        self._status("running")

    def _status(self, status: str, **fields: Any) -> None:
        if self._rank == 0:
            (self.run_dir / "status.json").write_text(json.dumps({"status": status, **fields}, indent=2) + "\n")

    # -- steps ---------------------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._memory.on_step_end(args, state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return  # the end-of-training summary and eval logs carry no training loss
        loss, norm = float(logs["loss"]), logs.get("grad_norm")
        norm = None if norm is None else float(norm)
        rec = self._record(args, state, loss, float(logs.get("learning_rate", 0.0)), norm)
        if self._rank == 0:
            with (self.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
            self._history.append(rec)
        # Under fp16 an overflowing step is DeepSpeed's to skip (its norm is inf by design): the loss only.
        bad_norm = norm is not None and not math.isfinite(norm) and not args.fp16
        if not math.isfinite(loss) or bad_norm:
            self._status("failed", error="non-finite loss or gradient norm", step=state.global_step)
            raise NonFiniteError(
                f"rank {self._rank}: loss {loss} / gradient norm {norm} at step {state.global_step} (the "
                f"{args.logging_steps} step(s) since the last log line; logging_steps=1 names the exact step); "
                "lower the learning rate, add warmup, or check the data")

    def _record(self, args: Any, state: Any, loss: float, lr: float, norm: float | None) -> dict[str, Any]:
        now = time.perf_counter()
        t, step, tokens = self._last
        dt, steps = max(now - t, 1e-9), max(state.global_step - step, 1)
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * self._world
        # Tokens only where the Trainer counts them (include_num_input_tokens_seen): counting costs it a
        # gather and a host sync per micro-step, which the callback will not switch on behind your back.
        seen = state.num_input_tokens_seen - tokens
        tokens_per_s = seen / dt if seen > 0 else None
        self._last = (now, state.global_step, state.num_input_tokens_seen)
        return {"step": state.global_step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens_per_s,
                "samples_per_s": samples / dt, "mfu": self._mfu(args, tokens_per_s, seen / samples),
                "step_time_s": dt / steps, "elapsed_s": now - self._t0}

    def _mfu(self, args: Any, tokens_per_s: float | None, seq_len: float) -> float | None:
        """As toolkit/train.py computes it, with the mean tokens per sample as the sequence length."""
        config = getattr(self._model, "config", None)
        layers, hidden = getattr(config, "num_hidden_layers", None), attention_width(config) if config else None
        import torch

        if tokens_per_s is None or not layers or not hidden or args.device.type != "cuda":
            return None
        peak = peak_flops_per_gpu(torch.cuda.get_device_name(args.device), _precision(args))
        if peak is None:
            return None
        total, trainable = count_params(self._model)
        fpt = flops_per_token(total, trainable, int(layers), int(hidden), round(seq_len))
        return tokens_per_s * fpt / (peak * self._world)

    # -- end -----------------------------------------------------------------------------------

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._memory.on_train_end(args, state, control)
        monitor = self._memory.monitor
        monitor.close()
        self._status("completed", steps=state.global_step)
        if self._rank == 0:
            print(closing_summary(self._history, self.run_dir, state.global_step, state.max_steps,
                                  monitor.rank_peaks, tensorboard=False), flush=True)
