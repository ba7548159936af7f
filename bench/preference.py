"""The toolkit's DPO against TRL's DPOTrainer, and against SFT on the same tokens (issue 47), one command per pair
file, every run in its own launch (the real deepspeed launcher), rows written as each run ends:

    python bench/preference.py --pairs /tmp/dc/pairs_short.jsonl --tokenizer /tmp/dc/llama --micro 16 \\
        --rows tk-z3,tk-z3-pre,trl-z3,trl-best-z3,tk-z2,trl-z2,sft-z3 --out OUT/short

Rows (NAME-zS, S the ZeRO stage; the same model, pairs, micro-batch of pairs, global batch, learning rate, bf16, and
the repo's ds_configs/zeroS.json for every system):
  tk         toolkit/train.py, train.objective=dpo, defaults: pairs packed one row per micro-batch, log-probs through
             the head in chunks, reference auto (engine: a frozen ZeRO-3 copy) for a full fine-tune;
  tk-pre     the same with pref.reference=precomputed (the pass before training is timed apart, not in tokens/s);
  tk-lora    LoRA (the toolkit's defaults), reference adapter; tk-lora-gc the same with checkpointing;
  tk-pad     tk with data.packing=false: pairs side by side, padded (TRL's layout), for the packing gain;
  tk-gc, tk-pre-gc  tk (and tk-pre) with model.gradient_checkpointing=true: TRL's default checkpoints too;
  tk...-leaves  any tk row with train.zero3_leaves=true (ZeRO-3: each decoder layer a leaf module, eager);
  tk-pre-half  tk-pre with half the pairs a micro-batch and grad_accum 2: the same pairs a step, half the activations;
  tk-syn, tk-syn-pre, tk-syn-lora  tk (tk-pre, tk-lora) on synthetic pairs of exactly --syn-seq tokens a sequence, --syn-micro pairs
             a micro-batch: the shape `toolkit plan --objective dpo` models; the row carries the plan's peak and
             tokens/s for that choice (planned_*) beside the measured ones;
  trl        bench/preference_trl.py --mode default: TRL's DPOTrainer at its defaults;
  trl-best   bench/preference_trl.py --mode best --precompute: Liger, padding-free, precomputed reference;
  trl-lora   TRL default with the same LoRA;
  tk-kto, tk-kto-pre, trl-kto  KTO on the same pairs split into unpaired rows (chosen desirable, rejected not), --micro
             rows a micro-batch (a row: its completion and a mismatched one, the tokens of a pair): the toolkit
             (engine or precomputed reference) and TRL's KTOTrainer at its defaults;
  sft        the toolkit's SFT on the same sequences (every chosen and rejected as a prompt + completion row), packed
             into rows of --sft-seq tokens: what a preference step's tokens cost as next-token training.
tokens/s counts the real tokens of both sequences of each pair (prompt included; for sft every real token), per
second over the steps after --warmup; peak is torch's max allocated over ranks. The model: --model (a preset, random
init; its vocabulary holds the tokenizer's ids).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _rows import launcher, run_rows  # bench/ is first on the path: this file is run as a script

ROOT = Path(__file__).resolve().parent.parent


def _toolkit(name: str, stage: int, args: argparse.Namespace, out: Path) -> list[str]:
    run_dir = out / name
    total = args.warmup + args.steps
    common = [f"model.name={args.model}", f"model.tokenizer={args.tokenizer}", "train.path=raw",
              "train.precision=bf16", "train.export=false", f"train.lr={args.lr}", "train.warmup_steps=1",
              "train.log_every=1", f"train.max_steps={total}", "memory.every=1", "metrics.tensorboard=false",
              f"train.run_dir={run_dir}", f"data.cache_dir={out / 'cache'}", "train.overwrite=true"]
    if name.startswith("sft"):
        return [*launcher(args), str(ROOT / "toolkit/train.py"), "--ds", str(ROOT / f"ds_configs/zero{stage}.json"),
                *common, f"data.source={out / 'sft.jsonl'}", f"data.seq_len={args.sft_seq}",
                f"train.micro_batch_size={args.sft_micro}", "data.packing=true"]
    kind = name.rsplit("-z", 1)[0]
    if kind.startswith("tk-syn"):  # synthetic pairs, every sequence --syn-seq long: what toolkit plan models
        ref = {"tk-syn-pre": ["pref.reference=precomputed"], "tk-syn-lora": ["lora.enabled=true"]}.get(kind, [])
        return [*launcher(args), str(ROOT / "toolkit/train.py"), "--ds", str(ROOT / f"ds_configs/zero{stage}.json"),
                *common, "train.objective=dpo", "data.source=synthetic", f"data.seq_len={args.syn_seq}",
                f"data.num_samples={total * args.syn_micro * args.gpus}", f"train.micro_batch_size={args.syn_micro}",
                *ref]
    if kind.startswith("tk-kto"):
        ref = ["pref.reference=precomputed"] if kind == "tk-kto-pre" else []
        return [*launcher(args), str(ROOT / "toolkit/train.py"), "--ds", str(ROOT / f"ds_configs/zero{stage}.json"),
                *common, "train.objective=kto", f"data.source={out / 'kto.jsonl'}", f"data.seq_len={args.max_length}",
                f"train.micro_batch_size={args.micro}", *ref]
    gc = "model.gradient_checkpointing=true"
    leaves = []
    if kind.endswith("-leaves"):  # ZeRO-3: the decoder layers as leaf modules, eager (train.zero3_leaves=true)
        kind, leaves = kind.removesuffix("-leaves"), ["train.zero3_leaves=true"]
    extra = {"tk": [], "tk-pre": ["pref.reference=precomputed"], "tk-lora": ["lora.enabled=true"],
             "tk-lora-gc": ["lora.enabled=true", gc], "tk-pad": ["data.packing=false"], "tk-gc": [gc], "tk-pre-gc": ["pref.reference=precomputed", gc],
             "tk-pre-half": ["pref.reference=precomputed", f"train.micro_batch_size={args.micro // 2}",
                             "train.grad_accum=2"]}[kind] + leaves
    return [*launcher(args), str(ROOT / "toolkit/train.py"), "--ds", str(ROOT / f"ds_configs/zero{stage}.json"),
            *common, "train.objective=dpo", f"data.source={args.pairs}", f"data.seq_len={args.max_length}",
            f"train.micro_batch_size={args.micro}", *extra]


def _trl(name: str, stage: int, args: argparse.Namespace, out: Path) -> list[str]:
    kind = name.rsplit("-z", 1)[0]
    flags = {"trl": ["--mode", "default"], "trl-best": ["--mode", "best", "--precompute"],
             "trl-lora": ["--mode", "default", "--lora"], "trl-kto": ["--mode", "default", "--objective", "kto"]}[kind]
    return [*launcher(args), str(ROOT / "bench/preference_trl.py"), "--model", args.model, "--tokenizer",
            args.tokenizer, "--pairs", args.pairs, "--ds", str(ROOT / f"ds_configs/zero{stage}.json"), "--micro",
            str(args.micro), "--grad-accum", "1", "--steps", str(args.warmup + args.steps), "--warmup-steps",
            str(args.warmup), "--max-length", str(args.max_length), *flags,
            "--out", str(out / f"{name}.json")]


def _toolkit_row(run_dir: Path, warmup: int) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in lines if "loss" in r]
    timed = [r for r in lines if r["step"] > warmup]
    snaps = [json.loads(x) for f in sorted((run_dir / "memory").glob("rank*.jsonl")) for x in f.read_text().splitlines()]
    peaks = [s["peak_allocated_gib"] for s in snaps if s.get("peak_allocated_gib") is not None]
    # over the window after the warmup steps, as the TRL script measures: each line's tokens/s covers the time since
    # the line before it (train.log_every=1)
    start = next(r for r in lines if r["step"] == warmup)
    window = sum(r["tokens_per_s"] * (r["elapsed_s"] - a["elapsed_s"]) for a, r in itertools.pairwise(lines)
                 if r["step"] > warmup)
    return {"tokens_per_s": window / (lines[-1]["elapsed_s"] - start["elapsed_s"]),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "peak_gib": max(peaks) if peaks else None, "losses": [round(r["loss"], 5) for r in lines],
            "accuracy_last": lines[-1].get("rewards/accuracies")}


def _planned(name: str, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """`toolkit plan --objective dpo`'s peak and tokens/s for a tk-syn row's exact choice."""
    lora = name.startswith("tk-syn-lora")
    ref = "precomputed" if name.startswith("tk-syn-pre") else "adapter" if lora else "engine"
    cmd = [sys.executable, "-m", "toolkit", "plan", "--model", args.model, "--gpus", str(args.gpus),
           "--gpu-mem", str(args.gpu_mem), "--seq", str(args.syn_seq), "--global-batch", str(args.syn_micro * args.gpus),
           "--objective", "dpo", "--reference", ref, "--stage", str(stage), "--offload", "none", "--micro-batch",
           str(args.syn_micro), "--json", *(["--lora"] if lora else [])]
    got = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    row = next(c for c in got["candidates"] if not c["grad_ckpt"])
    return {"planned_peak_gib": row["gpu_peak_gib"], "planned_tokens_per_s": row["tokens_per_s_per_gpu"] * args.gpus}


def _files(pairs: Path, n: int, out: Path) -> Path:
    """The first n pairs (what the runs consume: a precomputed reference's pass covers the whole file, in TRL and
    here), every chosen and rejected sequence of them as an SFT row (prompt + response): the same tokens, and as a
    KTO row (prompt, completion, label: chosen desirable)."""
    rows = [json.loads(x) for x in pairs.read_text().splitlines()[:n]]
    used = out / "pairs.jsonl"
    used.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with (out / "sft.jsonl").open("w") as g, (out / "kto.jsonl").open("w") as k:
        for row in rows:
            for side in ("chosen", "rejected"):
                g.write(json.dumps({"prompt": row["prompt"], "response": row[side]}) + "\n")
                k.write(json.dumps({"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}) + "\n")
    return used


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--rows", required=True, help="comma-separated NAME-zSTAGE (module docstring)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--include", default="", help="the launcher's --include (localhost:1: the second GPU alone)")
    ap.add_argument("--port", type=int, default=29500, help="master ports from here (two drivers side by side)")
    ap.add_argument("--micro", type=int, default=8, help="pairs per micro-batch (and per step: grad_accum 1)")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per sequence at most (no pair is cut)")
    ap.add_argument("--sft-seq", type=int, default=4096)
    ap.add_argument("--sft-micro", type=int, default=2)
    ap.add_argument("--syn-seq", type=int, default=1024, help="tk-syn rows: tokens per sequence")
    ap.add_argument("--syn-micro", type=int, default=4, help="tk-syn rows: pairs per micro-batch")
    ap.add_argument("--gpu-mem", type=float, default=139, help="tk-syn rows: the plan's --gpu-mem (an H200: 139)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the toolkit's default, which the TRL script also sets")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=540, help="no run starts after this many seconds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.pairs = str(_files(Path(args.pairs), (args.warmup + args.steps) * args.micro * args.gpus, out))
    def read(name: str, stage: int) -> dict[str, Any]:
        if name.startswith("trl"):
            got = json.loads((out / f"{name}.json").read_text())
            steps = got["step_times_s"][args.warmup:]
            return {"tokens_per_s": got["tokens_per_s"], "peak_gib": got["peak_gpu_gib"],
                    "step_time_s": statistics.median(steps) if steps else None, "losses": got.get("losses"),
                    "precompute_s": got.get("precompute_s"), "trl": got["versions"].get("trl"),
                    "settings": got.get("settings"), "padded_tokens_per_s": got.get("padded_tokens_per_s")}
        row = _toolkit_row(out / name, args.warmup)
        return row | _planned(name, stage, args) if name.startswith("tk-syn") else row

    run_rows(args, out, lambda name, stage: (_trl if name.startswith("trl") else _toolkit)(name, stage, args, out),
             read, {"micro_pairs": args.micro, "gpus": args.gpus}, "preference.json", ("losses", "log_tail"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
