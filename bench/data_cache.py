"""Real data at scale: the tokenize-once cache against the embedded synthetic run and `datasets`' own `.map`.

    python bench/data_cache.py make --work /tmp/dc        # corpora, a BPE tokenizer and a local Llama, from local files
    python bench/data_cache.py run --work /tmp/dc --out bench/results/data_cache.json
    python bench/data_cache.py chat --work /tmp/dc --out bench/results/data_chat   # chat fine-tune + eval loss
    python bench/data_cache.py make --work /tmp/dc --files data100k                   # on a GPU machine:
    python bench/data_cache.py gpu --work /tmp/dc --out OUT.json --gpus 2 --files data100k

`make` builds everything from Python's standard-library sources on this machine (no downloads): jsonl files
of prompt/response pairs cut from them (100k and 1M rows; the 1M file is about 142M tokens), an 8k BPE
tokenizer trained on them, a chat jsonl (a user asks what a standard-library function does; the assistant
answers with its docstring) and a small local Llama directory (random init).

`run` times, for each data file, a first launch (the cache is built) and a second one (it is reused), each
`deepspeed --num_gpus 2 toolkit/train.py ... train.max_steps=3` on CPU, beside the embedded synthetic data:
wall time of the launch, time from launch to the first optimizer step, and host RSS per rank (the largest
snapshot in memory/rank{N}.jsonl). `gpu` does the same on GPU ranks (no DS_ACCELERATOR=cpu): the first
launch on N ranks builds the cache, the second on N reuses it, and a one-rank launch on the same cache
and a synthetic launch on N and on one rank stand beside them. The reference is `datasets`' own batched `.map` on the same 1M rows with
the same number of processes, timed in this script right before the 1M build (the same machine load).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _sources() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace") for p in sorted(lib.rglob("*.py")) if "site-packages" not in p.parts]


FILES = {"data100k": 100_000, "data1m": 1_000_000}


def make(work: Path, files: list[str]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    texts = _sources()
    lines = [ln for t in texts for ln in t.splitlines() if ln.strip()]
    rng = random.Random(0)  # one stream over both files, so each file is the same whichever are written
    if "docs" in files:
        _docs_file(texts, work / "docs.jsonl")
    last = max((list(FILES).index(f) for f in files if f in FILES), default=-1)
    for name, n in list(FILES.items())[:last + 1]:
        with open(work / f"{name}.jsonl", "w") if name in files else open(os.devnull, "w") as f:
            for _ in range(n):
                i = rng.randrange(len(lines) - 40)
                k, m = rng.randint(2, 8), rng.randint(3, 14)
                f.write(json.dumps({"prompt": "\n".join(lines[i:i + k]), "response": "\n".join(lines[i + k:i + k + m])})
                        + "\n")
    _chat_file(texts, work / "chat.jsonl")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = TEMPLATE
    model_dir = work / "llama"
    fast.save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    print(f"wrote {work}: {', '.join(f + '.jsonl' for f in files)}, chat.jsonl, llama/ (tokenizer + model)", flush=True)


def _docs_file(texts: list[str], path: Path, n: int = 600) -> None:
    """Long documents for `text` training: consecutive standard-library files joined until each reaches a
    length drawn from 4k-80k characters (about 1k-20k tokens of the 8k BPE tokenizer)."""
    rng = random.Random(1)
    docs, i = [], 0
    while len(docs) < n:
        want, parts, size = rng.randint(4_000, 80_000), [], 0
        while size < want:
            t = texts[i % len(texts)][: want - size]
            parts.append(t)
            size += len(t) + 1
            i += 1
        docs.append({"text": "\n".join(parts)})
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def _chat_file(texts: list[str], path: Path) -> None:
    """Real text in chat form: each documented standard-library function, asked about by name and signature."""
    rows = []
    for t in texts:
        try:
            tree = ast.parse(t)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)) and len(doc) > 40:
                sig = f"def {node.name}({ast.unparse(node.args)})"
                rows.append({"messages": [{"role": "system", "content": "You explain Python code briefly."},
                                          {"role": "user", "content": f"What does this function do?\n{sig}"},
                                          {"role": "assistant", "content": doc[:600]}]})
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _launch(work: Path, run_dir: Path, cache: Path, *over: str, gpus: int = 0) -> dict[str, Any]:
    """gpus=0: two CPU ranks (DS_ACCELERATOR=cpu); else that many GPU ranks."""
    ranks = gpus or 2
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(29700 + random.randrange(200)), "toolkit/train.py",
           "--ds", "ds_configs/zero2.json", f"model.name={work / 'llama'}", "data.seq_len=512", "train.max_steps=3",
           "train.path=raw", "train.export=false", "memory.every=1", f"train.run_dir={run_dir}", "train.overwrite=true",
           *over]
    env = os.environ | {"TOOLKIT_CACHE": str(cache), "PYTHONUNBUFFERED": "1"} | ({} if gpus else {"DS_ACCELERATOR": "cpu"})
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-4000:]}")
    snaps = {r: [json.loads(x) for x in (run_dir / "memory" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(ranks)}
    first = min(s["ts"] for s in snaps[0] if s["phase"] == "first_step")
    rss = {r: max(s["host_rss_gib"] for s in v) for r, v in snaps.items()}
    return {"launch_to_end_s": round(wall, 1), "launch_to_first_step_s": round(first - t0, 1),
            "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "host_rss_gib": {str(r): round(v, 2) for r, v in rss.items()},
            "cache_built": "tokenizing" in p.stdout + p.stderr, "cache_reused": "reusing the tokenized" in p.stdout}


def _datasets_map(work: Path, num_proc: int) -> float:
    """`datasets`' own way on the 1M rows: load_dataset + batched .map in num_proc processes, no cache reuse."""
    code = f"""
import time, resource, tempfile
from datasets import load_dataset
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(work / 'llama')!r})
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as d:
    ds = load_dataset("json", data_files={str(work / 'data1m.jsonl')!r}, split="train", cache_dir=d)
    def f(b):
        p = tok(b["prompt"])["input_ids"]; r = tok(b["response"], add_special_tokens=False)["input_ids"]
        return {{"input_ids": [(x + y)[:512] for x, y in zip(p, r)]}}
    ds.map(f, batched=True, num_proc={num_proc}, remove_columns=ds.column_names)
    print(time.perf_counter() - t0)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600,
                       env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    return round(float(p.stdout.strip().splitlines()[-1]), 1)


def run(work: Path, out: Path) -> None:
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    rows: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, CPU ranks (DS_ACCELERATOR=cpu)",
                            "command": "python bench/data_cache.py run --work WORK --out " + str(out)}
    rows["synthetic"] = _launch(work, work / "runs" / "synthetic", cache, "data.num_samples=64")
    for name in ("data100k", "data1m"):
        if name == "data1m":  # the reference right before the build it is compared with: the same machine load
            rows["datasets_map_1m_s"] = _datasets_map(work, int(os.environ.get("BENCH_NUM_PROC", os.cpu_count() or 1)))
        rows[name] = _file_rows(work, cache, name, [("first", 0), ("second", 0)])
    _write(out, rows)


def _file_rows(work: Path, cache: Path, name: str, launches: list[tuple[str, int]]) -> dict[str, Any]:
    """One corpus: its launches in order (label, GPU ranks; 0 = two CPU ranks), then what the build recorded."""
    src = work / f"{name}.jsonl"
    row: dict[str, Any] = {"file_mib": round(src.stat().st_size / 2**20, 1)}
    for label, gpus in launches:
        row[label] = _launch(work, work / "runs" / name, cache, f"data.source={src}", gpus=gpus)
    info = json.loads(next((cache / "data").glob(f"{name}-*/toolkit_cache.json")).read_text())
    row.update(tokens=info["tokens"], samples=info["samples"], build_s=round(info["build_s"], 1),
               num_proc=info["num_proc"])
    print(name, json.dumps(row), flush=True)
    return row


def _write(out: Path, rows: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


def gpu(work: Path, out: Path, gpus: int, files: list[str]) -> None:
    """The cache on a real multi-rank GPU launch: one build, every rank maps it; one rank beside it."""
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    rows: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, GPU ranks",
                            "command": f"python bench/data_cache.py gpu --work WORK --out {out} --gpus {gpus} "
                                       f"--files {','.join(files)}"}
    for n in (gpus, 1):
        rows[f"synthetic_{n}rank"] = _launch(work, work / "runs" / f"synthetic{n}", cache, "data.num_samples=64", gpus=n)
    for name in files:
        rows[name] = _file_rows(work, cache, name, [(f"first_{gpus}rank", gpus), (f"second_{gpus}rank", gpus),
                                                    ("second_1rank", 1)])
    _write(out, rows)


def chat(work: Path, out: Path) -> None:
    """A chat fine-tune of the local Llama on real text: the eval loss should fall (`toolkit report`)."""
    cache = work / "cache"
    run_dir = out / "run"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(29900 + random.randrange(90)), "toolkit/train.py",
           "--ds", "ds_configs/zero2.json", f"model.name={work / 'llama'}", f"data.source={work / 'chat.jsonl'}",
           "data.seq_len=256", "data.packing=true", "data.eval_fraction=0.02", "train.eval_every=20",
           "train.max_steps=120", "train.micro_batch_size=4", "train.lr=1e-3", "train.warmup_steps=10",
           "train.path=raw", "train.export=false", "memory.every=20", "train.log_every=5",
           f"train.run_dir={run_dir}", "train.overwrite=true"]
    env = os.environ | {"DS_ACCELERATOR": "cpu", "TOOLKIT_CACHE": str(cache)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=3600)
    subprocess.run([sys.executable, "-m", "toolkit", "report", str(run_dir)], cwd=ROOT, check=True)
    print(" ".join(cmd))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("make", "run", "gpu", "chat"))
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gpus", type=int, default=2, help="gpu: GPU ranks of the multi-rank launches")
    ap.add_argument("--files", default="data100k,data1m",
                    help="make, gpu: which corpora (data100k, data1m; make also docs: long documents, docs.jsonl)")
    a = ap.parse_args()
    files = a.files.split(",")
    if unknown := set(files) - set(FILES) - ({"docs"} if a.what == "make" else set()):
        ap.error(f"unknown --files {sorted(unknown)}; known: {', '.join(FILES)}")
    if a.what == "make":
        make(a.work, files)
    elif a.what == "gpu":
        gpu(a.work, a.out or ROOT / "bench/results/data_cache_gpu.json", a.gpus, files)
    elif a.what == "run":
        run(a.work, a.out or ROOT / "bench/results/data_cache.json")
    else:
        chat(a.work, a.out or ROOT / "bench/results/data_chat")


if __name__ == "__main__":
    main()
