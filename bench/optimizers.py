"""Muon and bf16 optimizer states on one GPU, the toolkit's raw path (issue 62). Every run is `toolkit/train.py`
through the real `deepspeed` launcher with a config from `toolkit gen-config`; `toolkit report` tabulates them.

    python bench/optimizers.py make --work W          # corpus + BPE tokenizer + a small Llama, local files only
    python bench/optimizers.py quality --work W --out OUT [--steps 1000]
    python bench/optimizers.py speed --out OUT --rows llama-1b      # Muon vs AdamW step time at ZeRO-2 and ZeRO-3
    python bench/optimizers.py speed --out OUT --rows llama-3-8b    # bf16 states without offload vs the planned offload

quality: four arms on the same corpus (this machine's Python standard-library sources, as bench/fp8_ab.py makes
it), model, seed and schedule, side by side on the one GPU: AdamW with fp32 states (the reference), AdamW with bf16
master weights and states, Muon (DeepSpeed's: lr 0.02 and momentum 0.95 on the hidden matrices, the Adam half at
AdamW's lr), Muon with bf16 states. ZeRO-2, bf16, no gradient clipping in any arm (Muon at ZeRO 1-3 cannot clip:
toolkit/config/optimizers.py), AdamW at lr 3e-4 with betas (0.9, 0.95). The bound (bf16 states against fp32 states):
the mean loss over the last 100 steps within 1%, relative (bench/fp8_ab.py's rule). Muon against AdamW: reported as
it is.

speed: synthetic data, each row alone on the GPU, 10 steps (toolkit report's median excludes the first).
  llama-1b: seq 2048, 16 sequences a step (micro 4 x 4), ZeRO-2 and ZeRO-3, AdamW and Muon.
  llama-3-8b: seq 4096, 16 sequences a step, checkpointing, memory.gpu_limit_gib=80 (an 80 GiB card on the H200):
    the plan's choice today (`toolkit plan --model llama-3-8b --gpus 1 --gpu-mem 80 --host-mem 120 --seq 4096
    --global-batch 16 --grad-ckpt`: ZeRO-3, 75% of the optimizer states offloaded, micro 8 x 2; with --host-mem 100,
    what a 128 GiB host keeps: 62.5% offloaded, micro 4 x 4) against bf16 master weights and states: the same plan's
    --optimizer-states bf16 choice (ZeRO-3 without offload, micro 4 x 4), and that with 25% offloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMOOTH = 100
BOUND = 0.01
ARMS = {  # name -> (optimizer, states, extra overrides)
    "adamw-fp32": ("adamw", "fp32", []), "adamw-bf16": ("adamw", "bf16", []),
    "adamw-bf16-nearest": ("adamw", "bf16", ["train.bf16_rounding=nearest"]),
    "muon-fp32": ("muon", "fp32", []), "muon-bf16": ("muon", "bf16", []),
}


def _ds(out: Path, name: str, stage: int, optimizer: str, states: str, **kw: object) -> Path:
    from toolkit.config import ds_config as dc

    path = out / "configs" / f"{name}.json"
    cfg = dc.gen_config(stage, optimizer=optimizer, optimizer_states=states, targets=("raw",), **kw)
    dc.write_config(cfg, path, force=True)
    return path


def make(work: Path) -> None:
    """bench/fp8_ab.py's corpus and tokenizer; a smaller Llama (hidden 1024, 8 layers) so four arms share a GPU."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    import fp8_ab

    fp8_ab.make(work)
    tok = AutoTokenizer.from_pretrained(work / "llama")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      rope_theta=500000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model_dir = work / "small"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    print(f"wrote {model_dir}")


def quality(work: Path, out: Path, steps: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    procs = []
    for i, (arm, (optimizer, states, extra)) in enumerate(ARMS.items()):
        ds = _ds(out, arm, 2, optimizer, states, precision="bf16")
        cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(29470 + i), "toolkit/train.py", "--ds", str(ds),
               f"model.name={work / 'small'}", f"data.source={work / 'corpus.jsonl'}", "data.format=text",
               "data.packing=true", "data.seq_len=1024", "data.eval_fraction=0.01", f"data.cache_dir={work / 'cache'}",
               "train.path=raw", "train.micro_batch_size=8", f"train.max_steps={steps}", "train.lr=3e-4",
               "train.warmup_steps=100", "train.betas=[0.9,0.95]", "train.grad_clip=0", "train.precision=bf16",
               "train.log_every=1", "train.eval_every=250", "train.export=false", "memory.every=100",
               f"train.run_dir={out / arm}", "train.overwrite=true", *extra]
        log = (out / f"{arm}.log").open("w")
        procs.append((arm, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
        if i == 0:
            time.sleep(25)  # the first arm tokenizes the corpus into the shared cache; the others reuse it
    rcs = {arm: p.wait() for arm, p in procs}
    print(json.dumps(rcs))
    subprocess.run([sys.executable, "-m", "toolkit", "report", *(str(out / a) for a in ARMS if rcs[a] == 0),
                    "-o", str(out / "compare")], cwd=ROOT, check=False)
    return verdict(out) if not any(rcs.values()) else 1


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def verdict(out: Path) -> int:
    means = {arm: statistics.mean(_losses(out / arm)[-SMOOTH:]) for arm in ARMS}
    evals = {}
    for arm in ARMS:
        rows = [json.loads(x) for x in (out / arm / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
        evals[arm] = rows[-1]["eval_loss"] if rows else None
    rel = {f"{a} vs {a.split('-')[0]}-fp32": (means[a] - means[f"{a.split('-')[0]}-fp32"]) / means[f"{a.split('-')[0]}-fp32"]
           for a in ARMS if "bf16" in a}
    result = {"steps": {a: len(_losses(out / a)) for a in ARMS}, f"mean_last_{SMOOTH}": means,
              "eval_loss_final": evals, "relative": rel, "bound": BOUND,
              "pass": abs(rel["adamw-bf16 vs adamw-fp32"]) <= BOUND,
              "muon vs adamw (fp32 states), relative": (means["muon-fp32"] - means["adamw-fp32"]) / means["adamw-fp32"]}
    print(json.dumps(result, indent=1))
    (out / "verdict.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["pass"] else 1


def curves(out: Path) -> int:
    """Per-step losses read back from the arms' consoles (the progress bar prints each step's loss to 4 decimals),
    for when the run directories did not come back: losses.csv and curves.png (a 20-step mean)."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = {}
    for arm in ARMS:
        text = (out / f"{arm}.log").read_text(errors="replace")
        losses[arm] = {int(n): float(v) for n, v in re.findall(r"\|\s*(\d+)/\d+ \[[^\]]*loss=([0-9.]+)", text)
                       if int(n) > 0}
    steps = sorted(set.intersection(*(set(v) for v in losses.values())))
    rows = ["step," + ",".join(ARMS)] + [f"{n}," + ",".join(f"{losses[a][n]:.4f}" for a in ARMS) for n in steps]
    (out / "losses.csv").write_text("\n".join(rows) + "\n")
    fig, ax = plt.subplots(figsize=(9, 5))
    for arm in ARMS:
        ys = [losses[arm][n] for n in steps]
        smooth = [statistics.mean(ys[max(0, i - 19):i + 1]) for i in range(len(ys))]
        ax.plot(steps, smooth, label=arm)
    ax.set(xlabel="step", ylabel="training loss (20-step mean)", ylim=(1.8, 5.0),
           title="1,000 steps on real text: AdamW and Muon, fp32 and bf16 states")
    ax.legend()
    fig.savefig(out / "curves.png", dpi=110, bbox_inches="tight")
    tail = {a: statistics.mean(losses[a][n] for n in steps[-SMOOTH:]) for a in ARMS}
    print(json.dumps({f"mean_last_{SMOOTH} (console, 4 decimals)": tail}, indent=1))
    return 0


def speed(out: Path, rows: str, steps: int, only: str | None = None, global_batch: int = 16,
          profile_step: int = 0) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    runs: list[tuple[str, Path, list[str]]] = []
    if rows == "llama-1b":
        common = ["model.name=llama-1b", "data.seq_len=2048", "train.micro_batch_size=4",
                  f"train.grad_accum={global_batch // 4}", "train.grad_clip=0"]
        if profile_step:
            common.append(f"train.profile_steps=[{profile_step},{profile_step}]")
        tail = f"-g{global_batch}" if global_batch != 16 else ""
        for stage in (2, 3):
            for optimizer in ("adamw", "muon"):
                name = f"llama-1b-z{stage}-{optimizer}{tail}"
                runs.append((name, _ds(out, name, stage, optimizer, "fp32", precision="bf16"), common))
        # ZeRO-3 Muon with the gradients copied into one contiguous bucket before the reduce, as gen-config wrote it
        # before: with reduce_scatter off (Muon's requirement) that bucket is all-reduced whole every micro-batch
        name = f"llama-1b-z3-muon-contiguous{tail}"
        ds = _ds(out, name, 3, "muon", "fp32", precision="bf16")
        cfg = json.loads(ds.read_text())
        cfg["zero_optimization"]["contiguous_gradients"] = True
        ds.write_text(json.dumps(cfg, indent=2) + "\n")
        runs.append((name, ds, common))
    elif rows == "llama-3-8b":
        common = ["model.name=llama-3-8b", "data.seq_len=4096", "model.gradient_checkpointing=true",
                  "memory.gpu_limit_gib=80", "train.grad_clip=0"]
        offload = _ds(out, "llama-3-8b-z3-offload75", 3, "adamw", "fp32", precision="bf16", offload_optimizer="cpu")
        cfg = json.loads(offload.read_text())
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.75
        offload.write_text(json.dumps(cfg, indent=2) + "\n")
        runs.append(("llama-3-8b-z3-offload75", offload, [*common, "train.micro_batch_size=8", "train.grad_accum=2"]))
        # the plan's fp32 choice on the lent machine (a 128 GiB host, of which the offload75 row could not keep 109):
        # `... --host-mem 100` chooses ZeRO-3 with 62.5% of the states on the CPU, micro 4 x 4, 93.3 GiB of host RAM
        name = "llama-3-8b-z3-offload62"
        ds = _ds(out, name, 3, "adamw", "fp32", precision="bf16", offload_optimizer="cpu")
        cfg = json.loads(ds.read_text())
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.625
        ds.write_text(json.dumps(cfg, indent=2) + "\n")
        runs.append((name, ds, [*common, "train.micro_batch_size=4", "train.grad_accum=4"]))
        # bf16 master weights and states: the plan's --optimizer-states bf16 choice (ZeRO-3 without offload, the
        # masters sharing the weights' storage, micro 4 x 4), and the same with 25% of the states on the CPU in
        # DeepSpeedCPUAdam (what the plan chose when it counted a master copy beside the weights)
        name = "llama-3-8b-z3-bf16states"
        runs.append((name, _ds(out, name, 3, "adamw", "bf16"), [*common, "train.micro_batch_size=4",
                                                                "train.grad_accum=4"]))
        name = "llama-3-8b-z3-bf16states-offload25"
        ds = _ds(out, name, 3, "adamw", "bf16", offload_optimizer="cpu")
        cfg = json.loads(ds.read_text())
        cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.25
        ds.write_text(json.dumps(cfg, indent=2) + "\n")
        runs.append((name, ds, [*common, "train.micro_batch_size=4", "train.grad_accum=4"]))
    else:
        raise SystemExit(f"unknown rows {rows!r}")
    if only:
        runs = [r for r in runs if r[0] in only.split(",")]
    rcs = {}
    for i, (name, ds, extra) in enumerate(runs):
        cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(29480 + i), "toolkit/train.py", "--ds", str(ds),
               "train.path=raw", f"train.max_steps={steps}", "train.warmup_steps=1", "train.export=false",
               "train.precision=bf16", "memory.every=1", f"train.run_dir={out / name}", "train.overwrite=true", *extra]
        with (out / f"{name}.log").open("w") as log:
            rcs[name] = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(name, "rc", rcs[name], flush=True)
    done = [str(out / n) for n, _, _ in runs if rcs[n] == 0]
    subprocess.run([sys.executable, "-m", "toolkit", "report", *done, "-o", str(out / "compare"), "--force"],
                   cwd=ROOT, check=False)
    (out / "rcs.json").write_text(json.dumps(rcs, indent=1) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--work", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--work", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--steps", type=int, default=1000)
    s = sub.add_parser("speed")
    s.add_argument("--out", required=True)
    s.add_argument("--rows", required=True, choices=("llama-1b", "llama-3-8b"))
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--only", default=None, help="comma-separated row names")
    s.add_argument("--global-batch", type=int, default=16, help="llama-1b: sequences a step (micro 4)")
    s.add_argument("--profile-step", type=int, default=0, help="llama-1b: torch.profiler over this step")
    c = sub.add_parser("curves")
    c.add_argument("out")
    v = sub.add_parser("verdict")
    v.add_argument("out")
    a = p.parse_args()
    if a.cmd == "make":
        make(Path(a.work))
        return 0
    if a.cmd == "quality":
        return quality(Path(a.work), Path(a.out), a.steps)
    if a.cmd == "speed":
        return speed(Path(a.out), a.rows, a.steps, a.only, a.global_batch, a.profile_step)
    if a.cmd == "curves":
        return curves(Path(a.out))
    return verdict(Path(a.out))


if __name__ == "__main__":
    raise SystemExit(main())
