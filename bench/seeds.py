"""The seed workloads (../shared/anchors.md) through the toolkit and through plain HF Trainer.

    # every variant of a suite, each in its own process (GPU memory of one run never leaks into the
    # next one's peak); toolkit variants go through the real deepspeed launcher
    python bench/seeds.py suite --runner toolkit --suite qwen --out OUT [--gpus 1] [--include localhost:0]
    python bench/seeds.py suite --runner hf --suite qwen --out OUT      # plain HF Trainer, no toolkit
    python bench/seeds.py table OUT/*.json > bench/results/seeds.md

Suites: bert (BERT-large seq-cls, batch 4, seq 512, fp32 eager and bf16+sdpa), qwen (Qwen2-0.5B-shape
SFT: fp32, bf16, mixed, checkpointing, LoRA, sdpa, all together), qwen-zero (ZeRO-2, ZeRO-3, ZeRO-3
offload), llama-2gpu (the ~1B preset at ZeRO-2/3/3+offload, both paths), zero-2gpu (BERT-large and
Qwen2-0.5B at ZeRO-2/3/3+offload on 2 GPUs; qwen-2gpu is its Qwen half), overhead (snapshot every step
vs off). Every figure in bench/results comes from these commands.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])

QWEN = ["model.name=qwen2-0.5b", "data.seq_len=512", "data.num_samples=96", "train.micro_batch_size=2",
        "train.grad_accum=6", "train.max_steps=8", "train.lr=1e-5", "train.warmup_steps=1", "memory.every=1",
        "train.export=false"]
BERT = ["model.name=bert-large", "model.task=seq_cls", "data.seq_len=512", "data.num_samples=256",
        "train.micro_batch_size=4", "train.grad_accum=1", "train.max_steps=64", "train.lr=1e-5",
        "memory.every=8", "train.export=false"]
# grad_accum=2: with one micro-batch per step ZeRO-2 frees its gradient partition after every step
# while ZeRO-3 keeps a persistent one, so on 2 ranks ZeRO-3 cannot peak lower (bench/results/anatomy.md)
LLAMA = ["model.name=llama-1b", "data.seq_len=512", "data.num_samples=160", "train.micro_batch_size=4",
         "train.grad_accum=2", "train.max_steps=6", "train.lr=1e-5", "memory.every=1", "train.export=false",
         "train.precision=bf16"]
GPT2 = ["model.name=gpt2-124m", "data.seq_len=1024", "data.num_samples=1024", "train.micro_batch_size=16",
        "train.max_steps=30", "train.precision=bf16", "train.export=false", "train.path=raw"]

# name -> (ds preset, overrides); mirrors the seed variants (anchors.md). DeepSpeed's bf16 keeps fp32
# master weights, so "bf16 weights" and "bf16 mixed" are one toolkit variant.
SUITES: dict[str, dict[str, tuple[str, list[str]]]] = {
    "bert": {
        "fp32-eager": ("zero0", [*BERT, "train.precision=fp32", "model.attn_implementation=eager"]),
        "bf16-sdpa": ("zero0", [*BERT, "train.precision=bf16", "model.attn_implementation=sdpa"]),
    },
    "qwen": {
        "fp32": ("zero0", [*QWEN, "train.precision=fp32", "model.attn_implementation=eager"]),
        "bf16": ("zero0", [*QWEN, "train.precision=bf16", "model.attn_implementation=eager"]),
        "checkpointing": ("zero0", [*QWEN, "train.precision=bf16", "model.attn_implementation=eager",
                                    "model.gradient_checkpointing=true"]),
        "lora": ("zero0", [*QWEN, "train.precision=bf16", "model.attn_implementation=eager", "lora.enabled=true"]),
        "sdpa": ("zero0", [*QWEN, "train.precision=bf16", "model.attn_implementation=sdpa"]),
        "all": ("zero0", [*QWEN, "train.precision=bf16", "model.attn_implementation=sdpa",
                          "model.gradient_checkpointing=true", "lora.enabled=true"]),
    },
    "qwen-zero": {
        "zero2": ("zero2", [*QWEN, "train.precision=bf16"]),
        "zero3": ("zero3", [*QWEN, "train.precision=bf16"]),
        "zero3-offload": ("zero3_offload", [*QWEN, "train.precision=bf16"]),
    },
    "llama-2gpu": {
        f"{path}-{stage}": (stage, [*LLAMA, f"train.path={path}"])
        for stage in ("zero2", "zero3", "zero3_offload") for path in ("raw", "trainer")
    },
    # ZeRO-2 vs ZeRO-3 per-rank peaks on models without llama-1b's 263M-parameter tied vocabulary
    "zero-2gpu": {
        f"{model}-{stage}": (stage, [*base, "train.max_steps=10", "train.precision=bf16", "memory.every=1"])
        for model, base in (("bert", BERT), ("qwen", QWEN)) for stage in ("zero2", "zero3", "zero3_offload")
    },
    "smoke": {
        f"{path}-{stage}": (stage, ["model.name=tiny", "train.max_steps=3", "memory.every=1", "train.precision=bf16",
                                    f"train.path={path}"])
        for stage in ("zero3", "zero2_offload") for path in ("raw", "trainer")
    },
    "overhead": {
        f"every{n}-{i}": ("zero2", [*GPT2, f"memory.every={n}"]) for i in range(2) for n in (0, 1)
    },
}
# the Qwen half of zero-2gpu, for tests/gpu
SUITES["qwen-2gpu"] = {k: v for k, v in SUITES["zero-2gpu"].items() if k.startswith("qwen-")}

EXTRA: list[str] = []
# The memory figures committed from these suites (seeds_tables.md, two_gpu.md, anatomy.md) were measured
# before the speed defaults: h^2-based ZeRO sizes and no Liger kernels. Pinned, so the same command
# still measures the same configuration; bench/speed.py measures the defaults.
PINNED = ["train.zero_sizes=memory", "model.liger=false"]


def summarize(run_dir: Path) -> dict[str, Any]:
    """Peaks over the whole run from every rank's memory file; throughput without the first step."""
    mem: dict[int, dict[str, float]] = {}
    for f in sorted((run_dir / "memory").glob("rank*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        rank = rows[0]["rank"]
        mem[rank] = {k: max((r[k] or 0.0) for r in rows)
                     for k in ("peak_allocated_gib", "peak_reserved_gib", "nvml_used_gib", "reserved_gib")}
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics
    return {"per_rank": mem, "losses": [m["loss"] for m in metrics], "samples_per_s": statistics.median(m["samples_per_s"] for m in later),
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in later),
            "final_loss": metrics[-1]["loss"], "steps": len(metrics)}


def run_suite(runner: str, suite: str, out: Path, gpus: int, include: str | None, port: int,
              only: list[str]) -> None:
    import os
    import subprocess

    variants = HF_VARIANTS[suite] if runner == "hf" else SUITES[suite]
    results = {}
    for name in variants:
        if only and name not in only:
            continue
        one = [str(Path(__file__).resolve()), runner, "--suite", suite, "--only", name, "--out", str(out / "one"),
               "--extra", *EXTRA]
        if runner == "toolkit":
            where = ["--include", include] if include else ["--num_gpus", str(gpus)]
            cmd = ["deepspeed", *where, "--master_port", str(port), *one]
        else:
            cmd = [sys.executable, *one]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=os.environ | {"PYTHONUNBUFFERED": "1"}).returncode
        f = out / "one" / f"{runner}-{suite}.json"
        results[name] = json.loads(f.read_text())["results"][name] if rc == 0 and f.exists() else {"rc": rc}
        f.unlink(missing_ok=True)
    (out / f"{runner}-{suite}.json").write_text(json.dumps({"runner": runner, "suite": suite,
                                                           "results": results}, indent=2))


def run_toolkit(suite: str, out: Path, only: list[str]) -> None:
    from tests.dist._multi_train import reset_accelerate
    from toolkit import train
    from toolkit.launch import dist

    results = {}
    for name, (ds, overrides) in SUITES[suite].items():
        if only and name not in only:
            continue
        reset_accelerate()
        run_dir = out / f"toolkit-{suite}-{name}"
        t0 = time.perf_counter()
        rc = train.main(["--ds", f"ds_configs/{ds}.json", *overrides, *PINNED, *EXTRA, f"train.run_dir={run_dir}"])
        wall = time.perf_counter() - t0
        gc.collect()
        _empty_cache()
        if dist.rank() == 0:
            results[name] = {"rc": rc, "wall_s": wall, "ds": ds, "overrides": overrides,
                             **(summarize(run_dir) if rc == 0 else {})}
            print(f"RESULT toolkit {suite} {name} {json.dumps(results[name]['per_rank'] if rc == 0 else rc)}",
                  flush=True)
    if dist.rank() == 0:
        (out / f"toolkit-{suite}.json").write_text(json.dumps({"runner": "toolkit", "suite": suite,
                                                               "results": results}, indent=2))


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --------------------------------------------------------------------------- plain HF Trainer


HF_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    # model dtype, TrainingArguments precision, attention, checkpointing, LoRA: as in the seeds
    "bert": {
        "fp32-eager": dict(dtype="float32", bf16=False, attn="eager"),
        "bf16-sdpa": dict(dtype="float32", bf16=True, attn="sdpa"),
    },
    "qwen": {
        "fp32": dict(dtype="float32", bf16=False, attn="eager"),
        "bf16": dict(dtype="bfloat16", bf16=False, attn="eager"),
        "bf16-mixed": dict(dtype="bfloat16", bf16=True, attn="eager"),
        "checkpointing": dict(dtype="float32", bf16=True, attn="eager", gc=True),
        "lora": dict(dtype="float32", bf16=True, attn="eager", lora=True),
        "sdpa": dict(dtype="bfloat16", bf16=True, attn="sdpa"),
        "all": dict(dtype="bfloat16", bf16=True, attn="sdpa", gc=True, lora=True),
    },
    "qwen-zero": {
        "zero2": dict(dtype="float32", bf16=True, attn="sdpa", ds="zero2"),
        "zero3": dict(dtype="float32", bf16=True, attn="sdpa", ds="zero3"),
        "zero3-offload": dict(dtype="float32", bf16=True, attn="sdpa", ds="zero3_offload"),
    },
}


def run_hf(suite: str, out: Path, only: list[str]) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from toolkit.config import ds_config as dc
    from toolkit.config.models import PRESETS
    from toolkit.config.schema import load_config
    from toolkit.runtime.data.batches import Collator, ListDataset, build_rows
    from toolkit.runtime.model import apply_lora, model_config

    class NvmlPeak(TrainerCallback):
        def __init__(self) -> None:
            self.peak, self.handle = 0.0, None
            if torch.cuda.is_available():
                import pynvml

                pynvml.nvmlInit()
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if self.handle is not None:
                import pynvml

                self.peak = max(self.peak, pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**30)

    results = {}
    for name, v in HF_VARIANTS[suite].items():
        if only and name not in only:
            continue
        toolkit_name = name if name in SUITES[suite] else "bf16"
        overrides = SUITES[suite][toolkit_name][1]
        cfg = load_config(None, [o for o in [*overrides, *EXTRA] if not o.startswith("memory.")])
        mc = model_config(cfg)
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if cfg.model.task == "seq_cls" else AutoModelForCausalLM
        ds = None
        if "ds" in v:
            ds = dc.preset(v["ds"])
            # HF Trainer fills only its own "auto" keys; these two are the toolkit's rule (24 h^2).
            # A plain HF user writes DeepSpeed's documented 1e9 there, so the baseline does too.
            for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
                if key in ds["zero_optimization"]:
                    ds["zero_optimization"][key] = 1_000_000_000
        args = TrainingArguments(
            output_dir=str(out / f"hf-{suite}-{name}"), per_device_train_batch_size=cfg.train.micro_batch_size,
            gradient_accumulation_steps=cfg.train.grad_accum, max_steps=cfg.train.max_steps,
            learning_rate=cfg.train.lr, bf16=v["bf16"], gradient_checkpointing=v.get("gc", False),
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, deepspeed=ds,
            remove_unused_columns=False, dataloader_drop_last=True)
        torch.manual_seed(0)
        model = auto.from_config(mc, dtype=getattr(torch, v["dtype"]), attn_implementation=v["attn"])
        assert PRESETS  # the same preset shapes as the toolkit
        if v.get("lora"):
            model = apply_lora(cfg, model)
        rows, _ = build_rows(cfg, mc.vocab_size, 0, None)
        _empty_cache()
        cb = NvmlPeak()
        trainer = Trainer(model=model, args=args, train_dataset=ListDataset(rows),
                          data_collator=Collator(0, cfg.model.task), callbacks=[cb])
        out_metrics = trainer.train().metrics
        cuda = torch.cuda.is_available()
        res = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
               "nvml_used_gib": cb.peak,
               "samples_per_s": out_metrics["train_samples_per_second"], "variant": v}
        results[name] = res
        print(f"RESULT hf {suite} {name} {json.dumps(res)}", flush=True)
        del trainer, model
        gc.collect()
        _empty_cache()
        try:
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
        except ImportError:
            pass
    (out / f"hf-{suite}.json").write_text(json.dumps({"runner": "hf", "suite": suite, "results": results},
                                                     indent=2))


# --------------------------------------------------------------------------- tables


def table(files: list[Path]) -> str:
    lines: list[str] = []
    for f in files:
        data = json.loads(f.read_text())
        lines += [f"\n### {data['runner']} / {data['suite']}\n",
                  "| variant | rank | peak allocated GiB | peak reserved GiB | NVML used GiB | samples/s | tokens/s |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in data["results"].items():
            if "per_rank" in r:
                for rank, m in sorted(r["per_rank"].items(), key=lambda kv: int(kv[0])):
                    lines.append(f"| {name} | {rank} | {m['peak_allocated_gib']:.2f} | {m['peak_reserved_gib']:.2f} | "
                                 f"{m['nvml_used_gib']:.2f} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} |")
            elif "peak_allocated_gib" in r:
                lines.append(f"| {name} | 0 | {r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} | "
                             f"{r['nvml_used_gib']:.2f} | {r['samples_per_s']:.1f} | - |")
            else:
                lines.append(f"| {name} | - | failed (rc={r.get('rc')}) | | | | |")
    return "\n".join(lines) + "\n"


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    mode = argv[0]
    if mode == "table":
        sys.stdout.write(table([Path(a) for a in argv[1:]]))
        return 0
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--suite", required=True, choices=list(SUITES))
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--extra", nargs="*", default=[], help="overrides appended to every run (CPU smoke tests)")
    p.add_argument("--runner", choices=("toolkit", "hf"), default="toolkit")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--include", default=None, help="deepspeed --include, e.g. localhost:1")
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args(argv[1:])
    EXTRA.extend(a.extra)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if mode == "suite":
        run_suite(a.runner, a.suite, out, a.gpus, a.include, a.port, a.only)
    elif mode == "toolkit":
        run_toolkit(a.suite, out, a.only)
    else:
        from toolkit.launch.dist import prepare_env

        prepare_env()
        run_hf(a.suite, out, a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
