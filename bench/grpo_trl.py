"""TRL's `GRPOTrainer`, timed: the TRL side of the toolkit-vs-TRL GRPO benchmark (bench/grpo.py drives both).

    deepspeed --num_gpus N bench/grpo_trl.py --model llama-1b --tokenizer TOK --prompts prompts.jsonl \\
        --ds ds_configs/zero3.json --micro 4 --generations 8 --max-completion 256 --steps 8 --warmup-steps 3 \\
        [--grad-ckpt on|off] [--vllm] [--cache static] --out OUT.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/grpo_trl.py --model tiny ...     # CPU check (gloo)

The model is built as bench/preference_trl.py builds it (a preset at the toolkit's random init, or a local
directory), the reward is bench/grpo_reward.py's, the prompts a jsonl of {"prompt": text}. --micro counts prompts per
rank: TRL's per_device_train_batch_size (which counts completions) is micro x generations, one generation batch a
step (steps_per_generation = gradient_accumulation_steps = 1). GRPOConfig at TRL's defaults otherwise (beta 0, loss
dapo, scale group, gradient checkpointing on, ds3_gather_for_generation on), with the toolkit's learning rate,
schedule and optimizer settings; --grad-ckpt off for TRL without checkpointing; --vllm: use_vllm with
vllm_mode=colocate; --cache static: GRPOConfig.cache_implementation="static".

Measured: a callback's wall time at each step end (after a synchronize); prompts/s = micro x ranks x timed steps /
their time; the time split from timers around TRL's own methods (rank 0's; TRL's profiling metrics reach only
wandb, mlflow or trackio): generate (`_generate_single_turn`: the ZeRO-3 gather and `generate`), reward
(`_calculate_rewards`), rollout (`_generate_and_score_completions`, both and the log-probs it takes), train (the
step's wall time less the rollout); the logged completion lengths; peak GPU memory per rank (max over ranks). Rank 0
writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

from grpo_reward import length  # noqa: E402 (bench/ is first on the path: the launcher runs this file)
from preference_trl import build_model, strict_json, sync, versions  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", type=Path, required=True, help='jsonl of {"prompt": text}')
    ap.add_argument("--ds", required=True)
    ap.add_argument("--micro", type=int, default=4, help="prompts per rank per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--grad-ckpt", choices=("on", "off"), default="on", help="on: TRL's default")
    ap.add_argument("--vllm", action="store_true", help="use_vllm=True, vllm_mode=colocate")
    ap.add_argument("--cache", default=None, choices=["static"], help="GRPOConfig.cache_implementation")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    a = ap.parse_args()
    if not 0 <= a.warmup_steps < a.steps:
        ap.error("--warmup-steps must be below --steps")
    return a


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with its rollout's parts timed (TRL's own profiling metrics go only to wandb, mlflow or trackio):
    generation (the whole-model gather and generate), rewards, and the rollout as a whole (with the old and
    reference log-probs where it computes them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.phase_s: dict[str, float] = {"generate": 0.0, "reward": 0.0, "rollout": 0.0}
        super().__init__(*args, **kwargs)

    def _timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        self.phase_s[name] += time.perf_counter() - t0
        return out

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("generate", super()._generate_single_turn, *args, **kwargs)

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("rollout", super()._generate_and_score_completions, *args, **kwargs)


class StepClock(TrainerCallback):
    def __init__(self, trainer: TimedGRPOTrainer) -> None:
        self.trainer = trainer
        self.ends: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.logs: list[dict[str, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        sync()
        self.ends.append(time.perf_counter())
        self.phases.append(dict(self.trainer.phase_s))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs:
            self.logs.append(dict(logs))


def main() -> None:
    a = parse_args()
    from datasets import Dataset
    from transformers import AutoTokenizer

    from toolkit.config.schema import TrainConfig

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    tk = TrainConfig()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    import deepspeed

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    extra: dict[str, Any] = {"use_vllm": True, "vllm_mode": "colocate"} if a.vllm else {}
    if a.cache:
        extra["cache_implementation"] = a.cache
    cfg = GRPOConfig(
        output_dir=str(a.out.parent / f".{a.out.stem}_trainer"), deepspeed=a.ds, bf16=cuda, use_cpu=not cuda,
        per_device_train_batch_size=a.micro * a.generations, gradient_accumulation_steps=1, max_steps=a.steps,
        num_generations=a.generations, max_completion_length=a.max_completion, learning_rate=tk.lr,
        lr_scheduler_type="cosine", warmup_steps=tk.warmup_steps, weight_decay=tk.weight_decay,
        adam_beta1=tk.betas[0], adam_beta2=tk.betas[1], adam_epsilon=tk.eps, max_grad_norm=1.0 if tk.grad_clip is None else tk.grad_clip, seed=a.seed,
        gradient_checkpointing=a.grad_ckpt == "on", logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, **extra)
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts = [json.loads(x) for x in a.prompts.read_text().splitlines() if x.strip()]
    need = a.steps * a.micro * world
    if len(prompts) < need:
        raise SystemExit(f"{a.prompts}: {len(prompts)} prompts, the run needs {need}")
    data = Dataset.from_list([{"prompt": p["prompt"]} for p in prompts[:need]])
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model, built = build_model(a.model, len(tok), 0, a.seed)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[length], args=cfg, train_dataset=data,
                               processing_class=tok)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    trainer.train()
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        timed = clock.ends[a.warmup_steps:]
        seconds = timed[-1] - clock.ends[a.warmup_steps - 1] if a.warmup_steps else timed[-1] - clock.ends[0]
        steps = len(timed) if a.warmup_steps else len(timed) - 1
        step_logs = [x for x in clock.logs if "loss" in x]
        # each step's phases (cumulative counters differenced), medians over the timed steps; train: the rest
        per_step = [{k: b[k] - c.get(k, 0.0) for k in b} for b, c in zip(clock.phases, [{}, *clock.phases],
                                                                          strict=False)]
        walls = [b - c for b, c in zip(clock.ends, [clock.ends[0], *clock.ends], strict=False)][1:]
        split = {f"time/{k}_s": statistics.median(x[k] for x in per_step[a.warmup_steps:])
                 for k in ("generate", "reward", "rollout")}
        split["time/train_s"] = statistics.median(w - x["rollout"] for w, x in zip(walls[a.warmup_steps - 1:],
                                                                                   per_step[a.warmup_steps:],
                                                                                   strict=False)) \
            if a.warmup_steps else None
        out = {"prompts_per_s": a.micro * world * steps / seconds,
               "step_time_s": statistics.median(b - c for b, c in zip(clock.ends[1:], clock.ends, strict=False)),
               "peak_gpu_gib": max(p for p in peaks if p is not None) if cuda else None,
               "completion_mean_length": [x.get("completions/mean_length") for x in step_logs],
               "rewards": [x.get("reward") for x in step_logs], "losses": [x.get("loss") for x in step_logs],
               "time_split_median": split, "model": built, "world": world, "versions": versions(),
               "settings": {"micro_prompts": a.micro, "generations": a.generations,
                            "max_completion_length": a.max_completion, "gradient_checkpointing": a.grad_ckpt == "on",
                            "use_vllm": a.vllm, "cache_implementation": cfg.cache_implementation, "beta": cfg.beta,
                            "loss_type": cfg.loss_type,
                            "ds3_gather_for_generation": cfg.ds3_gather_for_generation}}
        a.out.write_text(json.dumps(strict_json(out), indent=1))
        print(json.dumps({k: out[k] for k in ("prompts_per_s", "step_time_s", "peak_gpu_gib")}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
