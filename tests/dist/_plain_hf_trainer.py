"""A plain HF Trainer script, as a user writes one: nothing from the toolkit is imported. Launched by
tests/dist/test_hf_consumers.py as `deepspeed --num_gpus 2 _plain_hf_trainer.py OUT.json CONFIG...`.

Each DeepSpeed config trains a tiny GPT-2 (from a config, no download) for 2 steps with
`TrainingArguments(deepspeed=CONFIG)`, in turn in one launch (a launch costs ~10 s; the CPU ops build
once). Rank 0 writes {config: {"ok": bool, "loss": float | None, "error": str | None}} to OUT.json.
The TrainingArguments come first, the model after: under ZeRO-3 transformers then builds it inside
zero.Init, as the HF docs ask.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 128, 16


def dataset(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()})
    return rows


def train_one(config: str, out_dir: Path) -> float:
    args = TrainingArguments(
        output_dir=str(out_dir), deepspeed=config, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=2, learning_rate=1e-3, warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    result = trainer.train()
    return float(result.training_loss)


def reset_accelerate() -> None:
    # One process, several Trainers with different DeepSpeed configs: accelerate keeps its state
    # (the DeepSpeed plugin among it) process-wide, so each run starts from a clean one.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_file, configs = Path(args[0]), args[1:]
    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, dict[str, object]] = {}
    for config in configs:
        reset_accelerate()
        name = Path(config).name
        try:
            loss = train_one(config, out_file.parent / f"out-{Path(config).parent.name}-{Path(config).stem}")
            results[config] = {"ok": True, "loss": loss, "error": None}
            print(f"CONFIG {name} ok loss={loss:.4f}", flush=True)
        except Exception as e:  # the test compares refusals with `toolkit check`
            first = (str(e).strip().splitlines() or [""])[0]
            results[config] = {"ok": False, "loss": None, "error": f"{type(e).__name__}: {first}"}
            print(f"CONFIG {name} REFUSED on rank {rank}: {traceback.format_exc()}", flush=True)
    if rank == 0:
        out_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    # gloo's threads outlive destroy_process_group and can abort interpreter finalization (exit -6 on a
    # finished run); leave the way toolkit/launch/dist.exit_process does, written out here.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
