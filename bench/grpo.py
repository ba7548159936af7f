"""The toolkit's GRPO against TRL's GRPOTrainer (issue 49), one command per comparison, every run in its own launch
(the real deepspeed launcher), rows written as each run ends:

    python bench/grpo.py --prompts .pairs/prompts_128.jsonl --tokenizer .pairs/tok --model llama-1b \\
        --micro 4 --generations 8 --max-completion 256 --rows tk-z3,trl-z3,trl-nogc-z3 --out OUT

Rows (NAME-zS, S the ZeRO stage; the same model, prompts, prompts a step, completions a prompt and their length,
learning rate, bf16, reward (bench/grpo_reward.py) and the repo's ds_configs/zeroS.json for every system):
  tk         toolkit/train.py train.objective=grpo at its defaults (rl.*: TRL's), packed completions, no checkpointing,
             rollouts on a static KV cache (rl.generate_cache=auto on CUDA);
  tk-dyn     the same with rl.generate_cache=dynamic;
  trl        bench/grpo_trl.py: GRPOConfig at TRL's defaults (gradient checkpointing on, ds3_gather_for_generation on);
  trl-nogc   the same without gradient checkpointing;
  trl-static the same with GRPOConfig.cache_implementation="static" (checkpointing on);
  trl-vllm   use_vllm with vllm_mode=colocate (needs vllm beside the project's torch).
prompts/s: prompts a step over all ranks / the median step time after --warmup (rollout and update together); the
time split (generate, reward, reference or rollout, train) as each system reports it; peak: torch's max allocated,
max over ranks. The model: --model (a preset at random init: throughput only, rewards meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _rows import launcher, run_rows  # bench/ is first on the path: this file is run as a script

ROOT = Path(__file__).resolve().parent.parent


def _toolkit(name: str, stage: int, args: argparse.Namespace, out: Path) -> list[str]:
    return [*launcher(args), str(ROOT / "toolkit/train.py"), "--ds", str(ROOT / f"ds_configs/zero{stage}.json"),
            f"model.name={args.model}", f"model.tokenizer={args.tokenizer}", "train.path=raw",
            "train.objective=grpo", f"data.source={args.prompts}", f"rl.rewards={ROOT / 'bench/grpo_reward.py'}:length",
            f"rl.num_generations={args.generations}", f"rl.max_completion_length={args.max_completion}",
            f"train.micro_batch_size={args.micro}", "train.precision=bf16", "train.export=false",
            f"train.max_steps={args.warmup + args.steps}", "train.log_every=1", "memory.every=1",
            "metrics.tensorboard=false", f"train.run_dir={out / name}", "train.overwrite=true",
            f"data.cache_dir={out / 'cache'}", *(["rl.generate_cache=dynamic"] if name.startswith("tk-dyn") else []),
            *args.tk_extra]


def _trl(name: str, stage: int, args: argparse.Namespace, out: Path) -> list[str]:
    kind = name.rsplit("-z", 1)[0]
    flags = {"trl": [], "trl-nogc": ["--grad-ckpt", "off"], "trl-static": ["--cache", "static"],
             "trl-vllm": ["--vllm"]}[kind]
    return [*launcher(args), str(ROOT / "bench/grpo_trl.py"), "--model", args.model, "--tokenizer", args.tokenizer,
            "--prompts", args.prompts, "--ds", str(ROOT / f"ds_configs/zero{stage}.json"), "--micro", str(args.micro),
            "--generations", str(args.generations), "--max-completion", str(args.max_completion), "--steps",
            str(args.warmup + args.steps), "--warmup-steps", str(args.warmup), *flags, "--out", str(out / f"{name}.json")]


def _toolkit_row(run_dir: Path, warmup: int, prompts_a_step: int) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in lines if "loss" in r and r["step"] > warmup]
    snaps = [json.loads(x) for f in sorted((run_dir / "memory").glob("rank*.jsonl")) for x in f.read_text().splitlines()]
    peaks = [s["peak_allocated_gib"] for s in snaps if s.get("peak_allocated_gib") is not None]
    step = statistics.median(r["step_time_s"] for r in timed)
    return {"prompts_per_s": prompts_a_step / step, "step_time_s": step, "peak_gib": max(peaks) if peaks else None,
            "time_split_median": {k: statistics.median(r[k] for r in timed)
                                  for k in ("time/generate_s", "time/reward_s", "time/reference_s", "time/train_s")},
            "completion_mean_length": [r.get("completions/mean_length") for r in lines if "loss" in r]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True, help='jsonl of {"prompt": text} (bench/grpo_prompts.py)')
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--include", default="")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--micro", type=int, default=4, help="prompts per rank per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-completion", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=540, help="no run starts after this many seconds")
    ap.add_argument("--tk-extra", nargs="*", default=[], help="more overrides for the toolkit's rows (key=value)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = (args.warmup + args.steps) * args.micro * args.gpus
    used = out / "prompts.jsonl"  # exactly what the runs consume, for both systems
    used.write_text("".join(Path(args.prompts).read_text().splitlines(keepends=True)[:n]))
    args.prompts = str(used)
    def read(name: str, stage: int) -> dict[str, Any]:
        if name.startswith("trl"):
            got = json.loads((out / f"{name}.json").read_text())
            return {"prompts_per_s": got["prompts_per_s"], "step_time_s": got["step_time_s"],
                    "peak_gib": got["peak_gpu_gib"], "time_split_median": got["time_split_median"],
                    "completion_mean_length": got["completion_mean_length"], "settings": got["settings"],
                    "trl": got["versions"].get("trl")}
        return _toolkit_row(out / name, args.warmup, args.micro * args.gpus)

    run_rows(args, out, lambda name, stage: (_trl if name.startswith("trl") else _toolkit)(name, stage, args, out),
             read, {"micro_prompts": args.micro, "generations": args.generations,
                    "max_completion": args.max_completion, "gpus": args.gpus}, "grpo.json",
             ("log_tail", "completion_mean_length"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
