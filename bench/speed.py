"""Side-by-side speed: a bare DeepSpeed loop, the toolkit's raw and Trainer paths, plain HF Trainer.

    python bench/speed.py run --gpus 2 --out OUT [--only llama-1b-seq2048] [--variants bare,raw] [--steps 5]
    python bench/speed.py run --include localhost:2,3 --out OUT ...   (these GPUs only: runs side by side)
    python bench/speed.py table OUT/*.json --command "..." > bench/results/speed.md  (+ speed.json)
    python bench/speed.py markdown bench/results/speed.json   (the table of speed.json as it stands)

Every variant runs in its own process through the real `deepspeed` launcher, and every variant of a
workload trains the same global batch per optimizer step (32 sequences, whatever the GPU count); how
it is split into micro-batch x accumulation is each variant's own choice and is recorded. The bare
loop (bench/bare_loop.py) and plain HF Trainer (bench/hf_trainer.py) import nothing from toolkit/.

Per row: tokens/s per GPU (median over the timed steps, real tokens), MFU = (6N + 12·L·H·T) FLOPs per
token over 989e12, step time, peak allocated GiB (max over ranks), host RSS GiB (max over ranks).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _proc import call_group  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 32
PEAK_FLOPS = 989e12  # H100/H200 dense bf16

# workload -> (toolkit preset, sequence length, the bare loop's micro-batch: what the docs show)
WORKLOADS: dict[str, tuple[str, int, int]] = {
    "gpt2-124m-seq1024": ("gpt2-124m", 1024, 16),
    "qwen2-0.5b-seq2048": ("qwen2-0.5b", 2048, 4),
    "llama-1b-seq2048": ("llama-1b", 2048, 4),
    "tiny-seq64": ("tiny", 64, 2),  # CPU smoke test of this script only (--only tiny-seq64)
    # real data (--data-dir, made by `bench/data_cache.py make --files data100k,docs`), beside synthetic rows
    "llama-1b-seq2048-data100k": ("llama-1b", 2048, 4),
    "qwen2-0.5b-seq2048-data100k": ("qwen2-0.5b", 2048, 4),
    "llama-1b-seq8192": ("llama-1b", 8192, 1),
    "llama-1b-seq8192-docs": ("llama-1b", 8192, 1),
    # Mixture-of-Experts: the Qwen3-30B-A3B shape at full width with 3 of its 48 layers (what fits one H100 with
    # the bare loop's full logits); the bare loop runs transformers' default experts path (grouped_mm)
    "qwen3-30b-a3b-l3-seq4096": ("qwen3-30b-a3b", 4096, 2),
}
LAYERS = {"qwen3-30b-a3b-l3-seq4096": 3}  # workload -> decoder layers (model.num_layers / bare --layers)
# workload -> the file in --data-dir it trains on (tokenized with DIR/llama's 8k BPE tokenizer); others: synthetic.
# data100k: 100k prompt/response rows of about 118 tokens; docs: 600 text documents of about 1k-20k tokens.
SYNTHETIC_OF = {"llama-1b-seq2048-data100k": "llama-1b-seq2048", "qwen2-0.5b-seq2048-data100k": "qwen2-0.5b-seq2048",
                "llama-1b-seq8192-docs": "llama-1b-seq8192"}  # a real-data workload -> its synthetic twin
DATA: dict[str, str] = {"llama-1b-seq2048-data100k": "data100k.jsonl", "qwen2-0.5b-seq2048-data100k": "data100k.jsonl",
                        "llama-1b-seq8192-docs": "docs.jsonl"}
DEFAULT_WORKLOADS = ("gpt2-124m-seq1024", "qwen2-0.5b-seq2048", "llama-1b-seq2048")
# (stage, offload) per workload: ZeRO-2, ZeRO-3, and ZeRO-3 + optimizer offload for llama-1b
STAGES: dict[str, list[tuple[int, str]]] = {
    "gpt2-124m-seq1024": [(2, "none"), (3, "none")],
    "qwen2-0.5b-seq2048": [(2, "none"), (3, "none")],
    "llama-1b-seq2048": [(2, "none"), (3, "none"), (3, "optimizer")],
    "tiny-seq64": [(2, "none"), (3, "none")],
    "llama-1b-seq2048-data100k": [(2, "none"), (3, "none")],
    "qwen2-0.5b-seq2048-data100k": [(2, "none"), (3, "none")],
    "llama-1b-seq8192": [(2, "none"), (3, "none")],
    "llama-1b-seq8192-docs": [(2, "none"), (3, "none")],
    "qwen3-30b-a3b-l3-seq4096": [(2, "none"), (3, "none")],
}
# The toolkit's micro-batch per workload and stage (capped at the per-rank batch), as the rows in
# bench/results/speed.md ran. The fused loss frees the 128k-152k-vocabulary logits, which is what makes
# micro 8-16 fit. llama-1b ZeRO-3 ran at 8 there, before the fused loss came to ZeRO-3; 16 since
# (zero3_tuning.md, and what train.micro_batch_size=auto chose). GPT-2 has no Liger kernels: the docs' 16.
TOOLKIT_MICRO: dict[str, dict[int, int]] = {"gpt2-124m-seq1024": {2: 16, 3: 16}, "qwen2-0.5b-seq2048": {2: 8, 3: 8},
                                            "llama-1b-seq2048": {2: 16, 3: 16}, "tiny-seq64": {2: 4, 3: 4},
                                            "llama-1b-seq2048-data100k": {2: 16, 3: 16},
                                            "qwen2-0.5b-seq2048-data100k": {2: 8, 3: 8},
                                            "llama-1b-seq8192": {2: 4, 3: 4}, "llama-1b-seq8192-docs": {2: 4, 3: 4},
                                            # MoE: toolkit plan's choice (8 x 4, 53.9 GiB predicted, 58.5 measured;
                                            # its fastest, 16 x 2, would need 77.7 GiB of the H100's 80)
                                            "qwen3-30b-a3b-l3-seq4096": {2: 8, 3: 8}}
# bare-tuned: the bare loop with Liger's kernels at the micro-batch fastest for it, what a user tunes by hand.
# llama-1b on one H200: micro 16 x 2 65.8k/66.0k, 8 x 4 62.8k tokens/s (../shared/anchors.md, 2026-11-23);
# Qwen2-0.5B: 8 x 4 (97.4k, the same day). Capped at the per-rank batch like every micro-batch here.
BARE_TUNED_MICRO: dict[str, int] = {"gpt2-124m-seq1024": 16, "qwen2-0.5b-seq2048": 8, "llama-1b-seq2048": 16,
                                    "tiny-seq64": 4, "llama-1b-seq8192": 4}
VARIANTS = ("bare", "bare-tuned", "raw", "trainer", "hf")
# --tune NAME,...: extra toolkit rows that try one lever each (at ZeRO-3; ANY_STAGE ones at every stage) (../shared/notes/zero3_speed.md §3, §6):
# (training overrides, DeepSpeed JSON sections merged over the preset's, micro-batch or None).
# llama-1b: a decoder layer is 60.8M parameters, about 5.1e6 per leaf module; 1.2e8 prefetch = 2 layers.
SIZES = {"stage3_prefetch_bucket_size": 120_000_000, "stage3_param_persistence_threshold": 1_000_000}
LEAF = {"stage3_module_granularity_threshold": 6_000_000}
TUNES: dict[str, tuple[list[str], dict[str, Any], int | None]] = {
    "m16": ([], {}, 16),  # more compute per gather
    "flce": (["model.liger_fused_loss=true"], {}, 16),  # fused loss with the head registered as external
    "sizes": ([], {"zero_optimization": SIZES}, None),  # prefetch 2 layers ahead, small k/v projections and norms stay resident
    "leaf": ([], {"zero_optimization": LEAF}, None),  # one fetch per decoder layer instead of one per linear
    "all": (["model.liger_fused_loss=true"], {"zero_optimization": SIZES | LEAF}, 16),
    "compile": (["train.compile=torch"], {}, None),  # each decoder layer compiled in place, Liger's fused loss only
    "fp8": (["train.precision=fp8"], {}, None),  # torchao float8 matmuls in the decoder layers (compile on)
    "fp8-m32": (["train.precision=fp8"], {}, 32),  # ... at micro 32: float8 frees activation memory
    # DeepCompile: DeepSpeed's compiler passes (gather/release, prefetch, selective unsharding) on engine.compile();
    # its schedule re-profiles at step 5, so it needs --warmup 15 or so (zero3_speed.md §2). Liger's Triton kernels
    # and the fused loss's .item() are not known to work under it: eager HF modules.
    "deepcompile": (["train.compile=torch", "model.liger=false"], {"compile": {"deepcompile": True}}, None),
    "noliger": (["model.liger=false"], {}, None),  # eager without Liger: what DeepCompile is measured against
    "noflce": (["model.liger_fused_loss=false"], {}, None),  # Liger's norm/rope/swiglu, the loss through full logits
    # MoE at the bare loop's own micro-batch (2): the toolkit's default, without Liger, without its fused loss
    "m2": ([], {}, 2), "m2-noliger": (["model.liger=false"], {}, 2), "m2-noflce": (["model.liger_fused_loss=false"], {}, 2),
    "nopack": (["data.packing=false"], {}, None),  # real data one row per sequence, batches grouped by length
    # Mixture-of-Experts: each experts path (model.experts), against the toolkit's default (auto)
    **{f"experts-{path}": ([f"model.experts={path}"], {}, None) for path in ("grouped_mm", "liger", "eager")},
    "m8": ([], {}, 8),  # the planner's micro-batch for the reduced-layer MoE shape (its full logits never exist)
    # MoE without the load-balancing loss, on the bare loop's experts path (the bare loop trains no aux loss):
    # against experts-grouped_mm, what the loss and the expert-load metric cost
    "grouped_mm-noaux": (["moe.aux_loss_coef=0", "model.experts=grouped_mm"], {}, None),
    # DeepSpeed's AutoEP at the planner's micro 8, each GPU a share of the experts (autoep_size: the run's GPUs)
    "autoep-m8": ([], {"expert_parallel": {"enabled": True, "preset_model": "qwen3_moe"}}, 8),
}
ANY_STAGE = {"compile", "fp8", "fp8-m32", "nopack", "experts-grouped_mm", "experts-liger", "experts-eager", "m8", "autoep-m8",
             "grouped_mm-noaux", "noliger", "noflce", "m2", "m2-noliger", "m2-noflce"}  # the other levers are ZeRO-3's


def _ds_preset(stage: int, offload: str) -> str:
    return f"ds_configs/zero{stage}" + ("_offload_optimizer" if offload == "optimizer" else "") + ".json"


def _data_args(workload: str, data_dir: str) -> list[str]:
    """The toolkit overrides that train a real-data workload on its file (none for synthetic workloads)."""
    if workload not in DATA:
        return []
    if not data_dir:
        raise SystemExit(f"error: {workload} trains on {DATA[workload]}: give --data-dir (bench/data_cache.py make)")
    d = Path(data_dir).resolve()
    return [f"data.source={d / DATA[workload]}", f"model.tokenizer={d / 'llama'}", f"data.cache_dir={d / 'cache'}"]


def _command(variant: str, workload: str, stage: int, offload: str, gpus: int, port: int, out: Path,
             warmup: int, steps: int, micro: int | None, extra: list[str],
             ds_path: str | None = None, include: str = "", data_dir: str = "") -> tuple[list[str], Path]:
    model, seq, bare_micro = WORKLOADS[workload]
    where = ["--include", include] if include else ["--num_gpus", str(gpus)]
    launch = ["deepspeed", *where, "--master_port", str(port)]
    if variant in ("bare", "bare-tuned", "hf"):
        if workload in DATA:
            raise SystemExit(f"error: {variant} trains on random tokens; {workload} is for the toolkit's rows")
        tuned = variant == "bare-tuned"
        micro = micro or min(BARE_TUNED_MICRO.get(workload, bare_micro) if tuned else bare_micro, GLOBAL_BATCH // gpus)
        script = "bench/hf_trainer.py" if variant == "hf" else "bench/bare_loop.py"
        return [*launch, script, "--model", model, "--seq", str(seq), "--micro", str(micro), "--global-batch",
                str(GLOBAL_BATCH), "--stage", str(stage), "--offload", offload, "--warmup", str(warmup),
                "--steps", str(steps), "--out", str(out), *(["--liger"] if tuned else []),
                *(["--layers", str(LAYERS[workload])] if workload in LAYERS else [])], out
    micro = micro or min(TOOLKIT_MICRO[workload][stage], GLOBAL_BATCH // gpus)
    run_dir = out.with_suffix("")
    total = warmup + steps
    return [*launch, "toolkit/train.py", "--ds", ds_path or _ds_preset(stage, offload), f"model.name={model}",
            f"data.seq_len={seq}", f"data.num_samples={GLOBAL_BATCH * total}", f"train.micro_batch_size={micro}",
            f"train.grad_accum={GLOBAL_BATCH // (micro * gpus)}", f"train.max_steps={total}", f"train.path={variant}",
            "train.precision=bf16", "train.export=false", "train.lr=1e-4", "train.warmup_steps=1",
            "train.log_every=1", f"train.run_dir={run_dir}", *_data_args(workload, data_dir),
            *([f"model.num_layers={LAYERS[workload]}"] if workload in LAYERS else []), *extra], run_dir


def _toolkit_result(run_dir: Path, variant: str, warmup: int) -> dict[str, Any]:
    """The toolkit's own records: metrics.jsonl (one line per step) and memory/rank*.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in lines if r["step"] > warmup]
    snaps = [json.loads(x) for f in sorted((run_dir / "memory").glob("rank*.jsonl")) for x in f.read_text().splitlines()]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    cfg_versions = json.loads((run_dir / "versions.json").read_text())
    peaks = [s["peak_allocated_gib"] for s in snaps if s.get("peak_allocated_gib") is not None]
    rss = [s["host_rss_gib"] for s in snaps if s.get("host_rss_gib") is not None]
    first, last = lines[0], lines[-1]
    return {
        "variant": variant, "micro_batch": ds["train_micro_batch_size_per_gpu"],
        "grad_accum": ds["gradient_accumulation_steps"], "gpus": cfg_versions["world_size"],
        "step_times_s": [r["step_time_s"] for r in timed],
        "tokens_per_s_all": [r["tokens_per_s"] for r in timed],
        # steps 2..last as one window, for the metrics on/off comparison (the same window both ways)
        "window_tokens_per_s": (sum(b["tokens_per_s"] * (b["elapsed_s"] - a["elapsed_s"])
                                    for a, b in itertools.pairwise(lines))
                                / max(last["elapsed_s"] - first["elapsed_s"], 1e-9)) if len(lines) > 1 else None,
        "losses": [r["loss"] for r in lines], "liger": cfg_versions.get("liger_note"),
        "attention": cfg_versions.get("attention_note"), "packing": cfg_versions.get("packing"),
        "padding_waste": [r.get("padding_waste") for r in timed],
        "peak_allocated_gib": max(peaks) if peaks else None, "host_rss_gib": max(rss) if rss else None,
    }


def run(args: argparse.Namespace) -> int:
    global GLOBAL_BATCH
    unknown = [n for n in args.tune.split(",") if n and n not in TUNES]
    if unknown:
        print(f"error: unknown --tune {', '.join(unknown)}; known: {', '.join(TUNES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # The GPU image's "9.0a" breaks DeepSpeed's op builder; the toolkit rewrites it itself, a user of the
    # bare loop would have to (toolkit env says so). Same value for every variant: one cached FusedAdam.
    if env.get("TORCH_CUDA_ARCH_LIST", "").endswith("a"):
        env["TORCH_CUDA_ARCH_LIST"] = env["TORCH_CUDA_ARCH_LIST"].rstrip("a")
    variants = args.variants.split(",")
    if args.include:  # DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES next to --num_gpus: name the GPUs
        args.gpus = len(args.include.partition(":")[2].split(","))
    elif not args.gpus:
        print("error: give --gpus N or --include localhost:I,J", file=sys.stderr)
        return 2
    if args.global_batch_per_gpu:  # weak scaling: each GPU keeps the same work per optimizer step
        GLOBAL_BATCH = args.global_batch_per_gpu * args.gpus
    port = args.port
    cases = [(workload, stage, offload) for workload in (args.only.split(",") if args.only else DEFAULT_WORKLOADS)
             for stage, offload in STAGES[workload]
             if not args.stages or str(stage) + ("o" if offload != "none" else "") in args.stages.split(",")]
    # --repeat: every row of the run in turn, again and again (synthetic bare, raw, corpus raw, synthetic bare, ...),
    # so a drift of the machine over the run lands on every row alike and each row's spread is on record
    for rep in range(1, args.repeat + 1):
        for workload, stage, offload in cases:
            for variant in variants:
                for tag, extra, micro, zero in _extras(variant, workload, stage, offload, args):
                    tag += f"-{args.global_batch_per_gpu}pergpu" if args.global_batch_per_gpu else ""
                    name = (f"{workload}-z{stage}{'-off' if offload != 'none' else ''}-{args.gpus}gpu-{variant}{tag}"
                            + (f"-rep{rep}" if args.repeat > 1 else ""))
                    target = out / f"{name}.json"
                    ds_path = _tuned_preset(stage, offload, zero, out / "ds" / f"{name}.json") if zero else None
                    cmd, produced = _command(variant, workload, stage, offload, args.gpus, port, target,
                                             args.warmup, args.steps, micro, extra, ds_path, args.include,
                                             args.data_dir)
                    port += 1
                    t0 = time.perf_counter()
                    with (out / f"{name}.log").open("w") as log:
                        rc = call_group(cmd, ROOT, env, log, args.timeout)
                    wall = time.perf_counter() - t0
                    row: dict[str, Any] = {"workload": workload, "stage": stage, "offload": offload,
                                           "gpus": args.gpus, "variant": variant + tag, "repeat": rep, "rc": rc,
                                           "global_batch": GLOBAL_BATCH,
                                           "wall_s": round(wall, 1), "argv": " ".join(cmd)}
                    try:
                        got = (_toolkit_result(produced, variant, args.warmup) if variant in ("raw", "trainer")
                               else json.loads(target.read_text()))
                        row |= {k: v for k, v in got.items() if k not in ("variant", "gpus")}
                    except (OSError, ValueError, KeyError, IndexError) as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                    target.write_text(json.dumps(row, indent=1))
                    print(f"{name}: rc={rc} {wall:.0f}s {_summary(row)}", flush=True)
    return 0


def _extras(variant: str, workload: str, stage: int, offload: str,
            args: argparse.Namespace) -> list[tuple[str, list[str], int | None, dict[str, Any]]]:
    """Rows per variant: (name tag, training overrides, micro-batch or None, zero_optimization values).

    --overhead: instead of the plain toolkit row, metrics and snapshots every step vs (almost) off.
    --tune: after the plain toolkit row, one row per named lever (TUNES; at ZeRO-3 only, except ANY_STAGE)."""
    if variant in ("raw", "trainer") and args.overhead:
        return [("-metrics-on", ["memory.every=1", *args.set], None, {}),
                ("-metrics-off", ["memory.every=0", f"train.log_every={args.warmup + args.steps}", *args.set], None, {})]
    plain = not (getattr(args, "tune_only", False) and variant in ("raw", "trainer"))
    rows: list[tuple[str, list[str], int | None, dict[str, Any]]] = [("", list(args.set), None, {})] if plain else []
    if variant in ("raw", "trainer") and args.tune:
        for name in filter(None, args.tune.split(",")):
            if stage != 3 and name not in ANY_STAGE:
                continue
            over, zero, micro = TUNES[name]
            if "expert_parallel" in zero:
                zero = zero | {"expert_parallel": zero["expert_parallel"] | {"autoep_size": args.gpus}}
            rows.append((f"-{name}", [*over, *args.set], min(micro, GLOBAL_BATCH // args.gpus) if micro else None, zero))
    return rows


def _tuned_preset(stage: int, offload: str, sections: dict[str, dict[str, Any]], path: Path) -> str:
    """The shipped preset with some sections' values written over it (kept beside the result)."""
    ds = json.loads((ROOT / _ds_preset(stage, offload)).read_text())
    for key, values in sections.items():
        ds[key] = ds.get(key, {}) | values
    path.parent.mkdir(exist_ok=True)  # a subdirectory: `table OUT/*.json` reads results only
    path.write_text(json.dumps(ds, indent=1))
    return str(path)


def _summary(row: dict[str, Any]) -> str:
    times = row.get("step_times_s") or []
    if not times:
        return row.get("error", "no result")
    return f"micro {row.get('micro_batch')} x ga {row.get('grad_accum')}: {statistics.median(times):.3f} s/step"


# ----------------------------------------------------------------------------- table


def _flops_per_token(model: str, seq: int, layers: int = 0) -> float:
    """6N + 12·L·(heads x head dim)·T, N the active parameters (a Mixture-of-Experts token runs top-k experts),
    from the planner's read of the toolkit's preset (layers: that many decoder layers)."""
    sys.path.insert(0, str(ROOT))
    import dataclasses

    from toolkit.plan.shapes import load_shape

    shape = load_shape(model)
    if layers:
        shape = dataclasses.replace(shape, num_layers=layers)
    return 6 * shape.active_params + 12 * shape.num_layers * shape.num_heads * shape.head_dim * seq


def table(args: argparse.Namespace) -> int:
    rows = [json.loads(Path(f).read_text()) | {"measured_in": Path(f).parent.name, "source_file": Path(f).name,
                                              "source_dir": str(Path(f).resolve().parent)} for f in args.files]
    flops: dict[str, float] = {}
    out_rows = []
    for r, reps in _pool_repeats(rows):
        model, seq, _ = WORKLOADS[r["workload"]]
        times = r.get("step_times_s") or []
        row = {k: r.get(k) for k in ("workload", "stage", "offload", "gpus", "variant", "micro_batch",
                                     "grad_accum", "peak_allocated_gib", "host_rss_gib", "rc", "liger",
                                     "attention", "packing", "measured_in")}
        row["data"] = Path(DATA[r["workload"]]).stem if r["workload"] in DATA else "synthetic"
        if r.get("global_batch", GLOBAL_BATCH) != GLOBAL_BATCH:  # weak-scaling rows (run --global-batch-per-gpu)
            row["global_batch"] = r["global_batch"]
        row["gpu"] = args.gpu or "unknown"
        if times:
            step = statistics.median(times)
            tps = _tokens_per_s_per_gpu(r, seq)
            waste = [w for w in r.get("padding_waste") or [] if w is not None]
            if waste:
                row["padding_waste"] = round(statistics.mean(waste), 4)
            if r["workload"] not in flops:
                flops[r["workload"]] = _flops_per_token(model, seq, LAYERS.get(r["workload"], 0))
            row |= {"tokens_per_s_per_gpu": round(tps, 1), "mfu": round(tps * flops[r["workload"]] / PEAK_FLOPS, 4),
                    "step_time_s": round(step, 4)}
            if r.get("window_tokens_per_s"):
                row["window_tokens_per_s"] = round(r["window_tokens_per_s"], 1)
            if len(reps) > 1:  # each run's own median: the spread between runs of the same variant
                row["repeat_tokens_per_s_per_gpu"] = [round(_tokens_per_s_per_gpu(rep, seq), 1) for rep in reps]
        else:
            row |= {"tokens_per_s_per_gpu": None, "mfu": None, "step_time_s": None, "error": r.get("error")}
        out_rows.append(row)
    gpu = args.gpu or "unknown"
    sources = {name: {"commit": commit, "command": cmd} for name, commit, cmd in args.source or []}
    doc = {"command": args.command, "gpu": gpu, "date": datetime.date.today().isoformat(),
           "global_batch": GLOBAL_BATCH, "sources": sources, "rows": out_rows}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(_markdown(doc))
    return 0


def _tokens_per_s_per_gpu(r: dict[str, Any], seq: int) -> float:
    """Real data: the toolkit's own count of real (non-pad) tokens; synthetic rows are all tokens."""
    if r["workload"] in DATA:
        return statistics.median(r["tokens_per_s_all"]) / r["gpus"]
    return r.get("global_batch", GLOBAL_BATCH) * seq / statistics.median(r["step_times_s"]) / r["gpus"]


def _pool_repeats(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Rows of one variant repeated in one run (run --repeat) become one row: its timed steps pooled,
    peaks the max; also returned: each repeat's own row. Other rows pass through alone."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for i, r in enumerate(rows):
        # only files a --repeat run wrote (NAME-repN.json) pool, and only within one directory
        repeat = re.search(r"-rep\d+\.json$", r["source_file"]) is not None
        key = (*(r.get(k) for k in ("workload", "stage", "offload", "gpus", "variant")), r["source_dir"],
               "repeat" if repeat else i)
        groups.setdefault(key, []).append(r)
    out = []
    for group in groups.values():
        good = [r for r in group if r.get("rc") == 0 and r.get("step_times_s")]  # a failed repeat's steps stay out
        row = dict(group[0])
        if len(group) > 1:
            for k in ("step_times_s", "tokens_per_s_all", "padding_waste"):
                row[k] = [x for r in good for x in r.get(k) or []]
            for k in ("peak_allocated_gib", "host_rss_gib"):
                row[k] = max((r[k] for r in group if r.get(k) is not None), default=None)
            row["rc"] = next((r.get("rc") for r in group if r.get("rc") != 0), 0)
            row.pop("window_tokens_per_s", None)  # one window per run: --overhead compares within a run
        out.append((row, good))
    return out


def _markdown(doc: dict[str, Any]) -> str:
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        by.setdefault((r["workload"], r["stage"], r["offload"], r["gpus"]), {})[r["variant"]] = r
    lines = [f"Command: `{doc['command']}` ({doc['gpu']}, {doc['date']}). Global batch {doc['global_batch']} "
             "sequences per optimizer step for every variant (a variant ending -Kpergpu: K per GPU). Tokens/s per GPU, median of the timed steps; "
             "ratios against the bare loop (and the hand-tuned bare loop, bare-tuned) of the same workload, stage "
             "and run. MFU is bf16-equivalent (float8 rows count the same FLOPs against the bf16 peak).", "",
             "| workload | data | ZeRO | GPUs | variant | micro x accum | tokens/s/GPU | vs bare | vs tuned | vs synthetic "
             "| MFU | padding | peak GiB | host GiB | run | code |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (w, s, o, g), vs in by.items():
        def vs_row(r: dict[str, Any], base_name: str, vs: dict[str, dict[str, Any]] = vs) -> str:
            base_row = vs.get(base_name, {})
            t, base = r.get("tokens_per_s_per_gpu"), base_row.get("tokens_per_s_per_gpu")
            same_run = r.get("measured_in") == base_row.get("measured_in")
            return f"{t / base:.2f}x" if t and base and same_run else "other run" if t and base else "n/a"

        for name, r in vs.items():
            t = r.get("tokens_per_s_per_gpu")
            ratio, tuned = vs_row(r, "bare"), vs_row(r, "bare-tuned")
            twin = by.get((SYNTHETIC_OF.get(w), s, o, g), {}).get(name)  # the same variant on synthetic rows
            synth = vs_row(r, name, {name: twin}) if twin else ""
            stage = f"{s}" + (" + opt offload" if o != "none" else "")
            tput = f"{t / 1000:.1f}k" if t else f"failed (rc {r.get('rc')})"
            if t and r.get("repeat_tokens_per_s_per_gpu"):
                tput += " (" + " / ".join(f"{x / 1000:.1f}" for x in r["repeat_tokens_per_s_per_gpu"]) + ")"
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
            peak = f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else ""
            host = f"{r['host_rss_gib']:.1f}" if r.get("host_rss_gib") else ""
            pad = f"{100 * r['padding_waste']:.1f}%" if r.get("padding_waste") is not None else ""
            lines.append(f"| {w} | {r.get('data', 'synthetic')} | {stage} | {g} | {name} | {r.get('micro_batch')} x "
                         f"{r.get('grad_accum')} | {tput} | {ratio} | {tuned} | {synth} | {mfu} | {pad} | {peak} | {host} | "
                         f"{r.get('measured_in', '')} | "
                         f"{doc.get('sources', {}).get(r.get('measured_in'), {}).get('commit', '')} |")
    return "\n".join(lines)


def scaling(args: argparse.Namespace) -> int:
    """Scaling efficiency from a table JSON: per-GPU tokens/s on N GPUs over the same variant's on one GPU
    (same workload, stage and offload). 100% is linear; the runs each figure came from are named."""
    doc = json.loads(Path(args.json).read_text())
    one = {(r["workload"], r["stage"], r["offload"], r["variant"]): r for r in doc["rows"]
           if r["gpus"] == 1 and r.get("tokens_per_s_per_gpu")}
    lines = ["| workload | ZeRO | variant | 1 GPU | GPUs | per GPU | efficiency | runs |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        base = one.get((r["workload"], r["stage"], r["offload"], r["variant"]))
        t = r.get("tokens_per_s_per_gpu")
        if r["gpus"] > 1 and base and t:
            stage = f"{r['stage']}" + (" + opt offload" if r["offload"] != "none" else "")
            lines.append(f"| {r['workload']} | {stage} | {r['variant']} | {base['tokens_per_s_per_gpu'] / 1000:.1f}k | "
                         f"{r['gpus']} | {t / 1000:.1f}k | {100 * t / base['tokens_per_s_per_gpu']:.1f}% | "
                         f"{base.get('measured_in')}, {r.get('measured_in')} |")
    print("\n".join(lines))
    return 0


def markdown(args: argparse.Namespace) -> int:
    """The markdown table of a table JSON (what `table` prints), without the files it came from."""
    print(_markdown(json.loads(Path(args.json).read_text())))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--gpus", type=int, default=0)
    r.add_argument("--include", default="", help="localhost:I,J - run on these GPUs only (in place of --gpus)")
    r.add_argument("--out", required=True)
    r.add_argument("--only", default="", help="comma-separated workloads")
    r.add_argument("--data-dir", default="", help="real-data workloads: the directory bench/data_cache.py make wrote")
    r.add_argument("--stages", default="", help="comma-separated: 2, 3, 3o (ZeRO-3 + optimizer offload)")
    r.add_argument("--variants", default=",".join(VARIANTS))
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--port", type=int, default=29700)
    r.add_argument("--timeout", type=int, default=420, help="seconds per variant")
    r.add_argument("--tune", default="", help=f"comma-separated levers to add as toolkit rows (ZeRO-3 only except {', '.join(sorted(ANY_STAGE))}): "
                        f"{', '.join(TUNES)}")
    r.add_argument("--tune-only", action="store_true", help="toolkit rows: only the --tune ones, not the plain row")
    r.add_argument("--global-batch-per-gpu", type=int, default=0, metavar="K",
                   help=f"sequences per optimizer step per GPU (weak scaling: K x GPUs in all); default: "
                        f"{GLOBAL_BATCH} in all, whatever the GPU count")
    r.add_argument("--repeat", type=int, default=1,
                   help="run every variant this many times, in turn; `table` pools each variant's timed steps")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="toolkit override added to every toolkit row (repeatable), e.g. train.profile_steps=[6,8]: "
                        "a profiled window inside the timed steps slows them, so time such rows apart")
    r.add_argument("--overhead", action="store_true",
                   help="toolkit rows as metrics+snapshots every step vs (almost) off, in place of the plain row")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    t.add_argument("--command", default="")
    t.add_argument("--gpu", default="")
    t.add_argument("--json", default="bench/results/speed.json")
    t.add_argument("--source", nargs=3, action="append", metavar=("DIR", "COMMIT", "COMMAND"),
                   help="where rows measured in DIR came from (repeatable): rows record DIR as measured_in")
    c = sub.add_parser("scaling", help="scaling efficiency, 1 GPU to N, from a table JSON")
    c.add_argument("json")
    m = sub.add_parser("markdown", help="the markdown table of a table JSON")
    m.add_argument("json")
    a = p.parse_args(argv)
    return {"run": run, "table": table, "scaling": scaling, "markdown": markdown}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
