"""float8 against bf16 on real text: the same Llama-shaped model, data, seed and schedule, 1,000+ optimizer steps.

    python bench/fp8_ab.py make --work /tmp/ab                 # corpus + BPE tokenizer + model dir, local files only
    python bench/fp8_ab.py run --work /tmp/ab --out OUT [--steps 1000] [--together]
    python bench/fp8_ab.py verdict OUT/ab-bf16 OUT/ab-fp8       # smoothed final losses, the 1% bound

`make` needs no download: the corpus is this machine's Python standard-library sources (one document per
file, 1% held out for the eval loss), an 8k BPE tokenizer is trained on them, and the model directory holds
a randomly initialized Llama of hidden 2048, 8 layers (about 0.4B parameters), loaded by both arms. At hidden
2048 the size rule converts q, o, gate, up and down (k and v stay bf16), as on llama-1b.

`run` trains the two arms with `toolkit/train.py` on one GPU, raw path, ZeRO-2, both compiled (the only
difference is train.precision), and writes `toolkit report` of both into OUT/compare. `--together` runs the
arms side by side on the one GPU (each gets half of it; speed is not the point here, bench/speed.py's is).

The bound. Each arm's loss is smoothed with a mean over its last 100 optimizer steps (each step a mean over
about 8k tokens, so the window averages 0.8M tokens); float8 passes when that mean is within 1% of bf16's,
relative. Why 1%: it is the proposal of ../shared/notes/fp8_compile_offload.md §5. torchtitan and accelerate
publish overlapping curves without a number; a 1% gap in loss is a 1% gap in log-perplexity.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOOTH = 100  # optimizer steps in the final mean
BOUND = 0.01  # relative


def make(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts)
    texts = [t for t in (p.read_text(errors="replace") for p in files) if len(t) > 200]
    random.Random(0).shuffle(texts)
    with (work / "corpus.jsonl").open("w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    model_dir = work / "llama"
    fast.save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      rope_theta=500000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)  # one random init, loaded by both arms
    chars = sum(map(len, texts))
    print(f"wrote {work}: corpus.jsonl ({len(texts)} files, {chars / 1e6:.1f}M characters), llama/ (tokenizer, config)")


def _command(work: Path, out: Path, arm: str, steps: int, port: int) -> list[str]:
    return ["deepspeed", "--num_gpus", "1", "--master_port", str(port), "toolkit/train.py", "--ds", "ds_configs/zero2.json",
            f"model.name={work / 'llama'}", f"data.source={work / 'corpus.jsonl'}",
            "data.format=text", "data.packing=true", "data.seq_len=1024", "data.eval_fraction=0.01", f"data.cache_dir={work / 'cache'}",
            "train.path=raw", "train.micro_batch_size=8", "train.grad_accum=1", f"train.max_steps={steps}",
            "train.lr=3e-4", "train.warmup_steps=100", "train.weight_decay=0.1", "train.betas=[0.9,0.95]",
            "train.log_every=1", "train.eval_every=250", "train.compile=torch", f"train.precision={arm}",
            "train.export=false", "memory.every=100", f"train.run_dir={out / f'ab-{arm}'}", "train.overwrite=true"]


def run(work: Path, out: Path, steps: int, together: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    procs = []
    for i, arm in enumerate(("bf16", "fp8")):
        log = (out / f"ab-{arm}.log").open("w")
        procs.append((arm, subprocess.Popen(_command(work, out, arm, steps, 29450 + i), cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)))
        if not together:
            procs[-1][1].wait()
        elif i == 0:
            time.sleep(20)  # the first arm tokenizes the corpus into the shared cache; the second reuses it
    rcs = {arm: p.wait() for arm, p in procs}
    print(json.dumps(rcs))
    if any(rcs.values()):
        return 1
    subprocess.run([sys.executable, "-m", "toolkit", "report", str(out / "ab-bf16"), str(out / "ab-fp8"),
                    "-o", str(out / "compare")], cwd=ROOT, check=False)
    return verdict(out / "ab-bf16", out / "ab-fp8")


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]  # eval lines carry eval_loss only


def verdict(bf16: Path, fp8: Path) -> int:
    a, b = _losses(bf16), _losses(fp8)
    sa, sb = statistics.mean(a[-SMOOTH:]), statistics.mean(b[-SMOOTH:])
    rel = (sb - sa) / sa
    result = {"steps": [len(a), len(b)], f"bf16_mean_last_{SMOOTH}": round(sa, 4),
              f"fp8_mean_last_{SMOOTH}": round(sb, 4), "relative": round(rel, 5), "bound": BOUND,
              "pass": abs(rel) <= BOUND and len(a) == len(b) >= 1000}
    for name, d in (("bf16", bf16), ("fp8", fp8)):
        evals = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
        result[f"{name}_eval_loss_final"] = evals[-1].get("eval_loss") if evals else None
    print(json.dumps(result, indent=1))
    (fp8.parent / "verdict.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["pass"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--work", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--together", action="store_true")
    v = sub.add_parser("verdict")
    v.add_argument("bf16")
    v.add_argument("fp8")
    a = p.parse_args()
    if a.cmd == "make":
        make(Path(a.work))
        return 0
    if a.cmd == "run":
        return run(Path(a.work), Path(a.out), a.steps, a.together)
    return verdict(Path(a.bf16), Path(a.fp8))


if __name__ == "__main__":
    raise SystemExit(main())
