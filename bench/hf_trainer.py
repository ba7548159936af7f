"""Baseline: the plain Hugging Face Trainer with a DeepSpeed JSON, written by hand from the HF / DeepSpeed docs.

Imports nothing from `toolkit`. Same models, ZeRO JSON and arguments as bench/bare_loop.py (imported
from it: the launcher puts bench/ first on sys.path), and the same random full-length data:

    deepspeed --num_gpus G --master_port P bench/hf_trainer.py --model llama-1b --seq 2048 --micro 4 \
        --global-batch 64 --stage 3 --offload none --warmup 3 --steps 10 --out result.json

CPU smoke test (gloo, fp32): prefix with `DS_ACCELERATOR=cpu` and use `--model tiny`.
A TrainerCallback times each optimizer step (on_step_begin .. on_step_end); rank 0 writes the result JSON.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from bare_loop import ds_config, model_config, parse_args, start, write_result
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(Dataset):
    """Pre-generated random token ids at full length; labels = input_ids."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(4, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (all its micro-batches), GPU work included; losses as logged."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.t0 = 0.0
        self.times: list[float] = []
        self.losses: list[float] = []

    def _sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kw: Any) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self.t0)

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None,
               **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def train_timed(model: Any, targs: TrainingArguments, args: Any, vocab: int, cpu: bool) -> StepTimer:
    """The Trainer on random full-length rows for warmup + steps optimizer steps, each timed. Shared with
    qlora_hf.py."""
    data = RandomTokens((args.warmup + args.steps) * args.global_batch, args.seq, vocab, seed=1234)
    timer = StepTimer(cpu)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer])
    trainer.train()
    assert isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine), "the Trainer did not use DeepSpeed"
    return timer


def main() -> None:
    args = parse_args()
    cpu, device, _, grad_accum = start(args)
    total = args.warmup + args.steps

    with tempfile.TemporaryDirectory() as tmp:
        # TrainingArguments(deepspeed=...) creates the HfDeepSpeedConfig: it must exist before the model (ZeRO-3)
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.micro, gradient_accumulation_steps=grad_accum,
            max_steps=total, bf16=not cpu, learning_rate=1e-4, lr_scheduler_type="constant",
            deepspeed=ds_config(args, grad_accum, not cpu),
            logging_steps=1, report_to=[], save_strategy="no", dataloader_drop_last=True, disable_tqdm=True,
            use_cpu=cpu,
        )
        config = model_config(args.model, args.layers)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        timer = train_timed(model, targs, args, config.vocab_size, cpu)

    write_result(args, "hf", device, grad_accum, timer.times[args.warmup:], timer.losses, n_params, config)
    dist.barrier()


if __name__ == "__main__":
    main()
