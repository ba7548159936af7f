"""What the toolkit decided at run start for the configurations of the committed GPU benchmark rows, as a fixture.

    python bench/resolved_before.py --tree /tmp/before -o tests/fixtures/resolved_before.json

--tree is a checkout of the toolkit (here the code before the runtime refactor, commit f6c834c); its `toolkit/` is
imported, nothing else. For each workload below (a benchmark row's `toolkit/train.py` command: the DeepSpeed JSON,
the `section.key=value` overrides as the bench passed them, the ranks and the GPU it ran on) the script builds the
run spec as `toolkit/train.py` does (`load_config`, `build_spec`), then makes every decision that
`toolkit/runtime/loop.py` `run()` and `_run()` make before the model exists: compile, tiled MLPs and the
tiled+compiled auto rule, ZeRO-3's plain linear, Liger (with the MoE fused-loss rule), the experts path, the
attention plan, activation offload, the tiled loss, packing, precision. Nothing runs on a GPU: the queries those
decisions make of the machine are answered as the row's machine would (`_as_on`): CUDA present, bf16 supported,
torch's varlen kernel present, the card's memory (under `memory.gpu_limit_gib`: the cap plus the context allowance
the code adds itself, `dist.gpu_memory_bytes`), the host's memory, the ranks per node, Liger's model types (a fixed
list: liger-kernel is not installed here), an SM 9.0 GPU for float8's check.

A row that trained on a file (`data.source=...jsonl`) keeps its override; the decisions read only the settings, so
the file is replaced by a one-row stub of the same name and columns in a temporary directory. Paths in the
overrides (run directories, tokenizer, cache, plan) are the bench's own and are not read.

Output, per workload: name, ds (a path under the repo, or the DeepSpeed dict the bench generated), overrides,
world_size, gpu_gib (the card, or memory.gpu_limit_gib where the row set it), host_gib, page, and "decided":
stage, precision, fp8 (recipe or null), adapter_autocast, packing, attention (implementation, boundaries,
whole_rows, note: `attention.plan`'s, without for_run's kv-heads suffix, which probes the GPU), compile,
compile_why, tiled_mlp, tiled_loss, tiled_loss_tile (null when off), liger_kwargs, liger_reason, experts_path
(`ExpertsChoice.describe()`, null for a dense model), activation_offload {on, pinned (null when off)}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

GIB = 2**30
H100_GIB = 79.2  # NVIDIA H100 80GB HBM3, as torch reports it
H200_GIB = 139.8  # NVIDIA H200
DEFAULT_HOST_GIB = 125.0
# liger-kernel's MODEL_TYPE_TO_APPLY_LIGER_FN (0.8.x), the families the toolkit's presets and tests use among them;
# gpt2, bert and olmoe are not in it
LIGER_MODEL_TYPES = frozenset({
    "gemma", "gemma2", "gemma3", "gemma3_text", "glm4", "granite", "llama", "llama4", "llama4_text", "mistral",
    "mixtral", "mllama", "olmo2", "olmo3", "phi3", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3", "qwen3_moe",
    "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "smollm3",
})
SM90 = ((9, 0), "NVIDIA H100 80GB HBM3")

# DeepSpeed dicts the bench generates rather than reads from ds_configs/
# bench/plan_calibrate.py (and max_seq_probe.py through it): toolkit.plan.command.ds_config_for(Choice(stage 2, no
# offload, micro 1, accum 1, checkpointing, zero_sizes speed)); it equals ds_configs/zero2.json key for key
PLAN_ZERO2: dict[str, Any] = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "allgather_partitions": True, "allgather_bucket_size": 500000000, "reduce_scatter": True},
    "steps_per_print": 1000000000, "wall_clock_breakdown": False,
}
# bench/speed.py --tune autoep-m8 on 2 GPUs: ds_configs/zero3.json with this section added (_tuned_preset)
AUTOEP_2GPU: dict[str, Any] = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000,
                          "sub_group_size": 1000000000, "stage3_gather_16bit_weights_on_model_save": True},
    "steps_per_print": 1000000000, "wall_clock_breakdown": False,
    "expert_parallel": {"enabled": True, "preset_model": "qwen3_moe", "autoep_size": 2},
}


@dataclass(frozen=True)
class Workload:
    name: str
    ds: str | dict[str, Any]
    """A DeepSpeed JSON under the repo root, or the dict the bench generated."""
    overrides: str
    """The `section.key=value` arguments after `--ds`, as in the row's recorded command line."""
    world_size: int
    card_gib: float
    page: str
    host_gib: float = DEFAULT_HOST_GIB

    @property
    def override_list(self) -> list[str]:
        return self.overrides.split()

    @property
    def gpu_limit_gib(self) -> float:
        caps = [float(o.split("=", 1)[1]) for o in self.override_list if o.startswith("memory.gpu_limit_gib=")]
        return caps[-1] if caps else 0.0

    @property
    def gpu_gib(self) -> float:
        return self.gpu_limit_gib or self.card_gib


def _speed(model: str, seq: int, samples: int, micro: int, accum: int, steps: int, path: str, run_dir: str,
           tail: str = "") -> str:
    """bench/speed.py's toolkit command (_command), after --ds."""
    return (f"model.name={model} data.seq_len={seq} data.num_samples={samples} train.micro_batch_size={micro} "
            f"train.grad_accum={accum} train.max_steps={steps} train.path={path} train.precision=bf16 "
            f"train.export=false train.lr=1e-4 train.warmup_steps=1 train.log_every=1 train.run_dir={run_dir}"
            + (f" {tail}" if tail else ""))


DC = "data.source=/tmp/dc/{} model.tokenizer=/tmp/dc/llama data.cache_dir=/tmp/dc/cache"  # speed.py _data_args
PLAN_COMMON = ("train.path=raw train.export=false train.warmup_steps=1 memory.every=1 metrics.tensorboard=false "
               "train.zero_sizes=speed model.gradient_checkpointing=true model.liger=true")  # plan_calibrate _overrides

# The rows, with the command lines their per-row JSON (or the page) recorded.
WORKLOADS: tuple[Workload, ...] = (
    # real_data.md run s33 (1 H100): llama-1b seq 2048 ZeRO-2, synthetic, the corpus (packing), the Trainer path
    Workload("llama1b-s2048-z2-synthetic", "ds_configs/zero2.json",
             _speed("llama-1b", 2048, 224, 16, 2, 7, "raw", "/root/out/s/llama-1b-seq2048-z2-1gpu-raw"),
             1, H100_GIB, "bench/results/real_data.md"),
    Workload("llama1b-s2048-z2-data100k", "ds_configs/zero2.json",
             _speed("llama-1b", 2048, 224, 16, 2, 7, "raw", "/root/out/s/llama-1b-seq2048-data100k-z2-1gpu-raw",
                    DC.format("data100k.jsonl")),
             1, H100_GIB, "bench/results/real_data.md"),
    Workload("llama1b-s2048-z2-data100k-trainer", "ds_configs/zero2.json",
             _speed("llama-1b", 2048, 224, 16, 2, 7, "trainer",
                    "/root/out/s/llama-1b-seq2048-data100k-z2-1gpu-trainer", DC.format("data100k.jsonl")),
             1, H100_GIB, "bench/results/real_data.md"),
    # real_data.md run s34: train.precision=fp8 on the corpus (speed.py --tune fp8 appends it after bf16)
    Workload("llama1b-s2048-z2-data100k-fp8", "ds_configs/zero2.json",
             _speed("llama-1b", 2048, 224, 16, 2, 7, "raw", "/root/out/s/llama-1b-seq2048-data100k-z2-1gpu-raw-fp8",
                    DC.format("data100k.jsonl") + " train.precision=fp8"),
             1, H100_GIB, "bench/results/real_data.md"),
    # long_seq/README.md run s50 (one H200 of four): the tiled loss at 32,768 tokens, Liger's fused loss off
    Workload("tiled-loss-llama3.2-1b-32k", "ds_configs/zero2.json",
             "train.path=raw model.name=llama-3.2-1b data.seq_len=32768 data.num_samples=12 train.micro_batch_size=1 "
             "train.grad_accum=1 train.max_steps=6 train.precision=bf16 train.export=false train.warmup_steps=1 "
             "train.log_every=1 train.lr=1e-4 model.liger_fused_loss=false model.gradient_checkpointing=true "
             "model.tiled_loss=true train.run_dir=/tmp/o50/tl-true",
             1, H200_GIB, "bench/results/long_seq/README.md"),
    # fp8_compile.md run s26 (1 H200): float8 at ZeRO-3, compiled decoder layers as leaves
    Workload("llama1b-s2048-z3-fp8", "ds_configs/zero3.json",
             _speed("llama-1b", 2048, 256, 16, 2, 8, "raw", "/tmp/s26/llama-1b-seq2048-z3-1gpu-raw-fp8",
                    "train.precision=fp8"),
             1, H200_GIB, "bench/results/fp8_compile.md"),
    # multi_gpu.md run s30 (2 H200s): ZeRO-3, train.compile=torch (compiled leaves)
    Workload("llama1b-s2048-z3-compile-2gpu", "ds_configs/zero3.json",
             _speed("llama-1b", 2048, 256, 16, 1, 8, "raw", "/tmp/m3/llama-1b-seq2048-z3-2gpu-raw-compile",
                    "train.compile=torch"),
             2, H200_GIB, "bench/results/multi_gpu.md"),
    # multi_gpu.md run s31 (2 H200s): Qwen2-0.5B ZeRO-2, raw path
    Workload("qwen2-0.5b-s2048-z2-2gpu", "ds_configs/zero2.json",
             _speed("qwen2-0.5b", 2048, 256, 8, 2, 8, "raw", "/root/out/s31/qwen2-0.5b-seq2048-z2-2gpu-raw"),
             2, H200_GIB, "bench/results/multi_gpu.md"),
    # fp8_compile.md run s21 (1 H200): GPT-2-124M, train.compile=torch
    Workload("gpt2-124m-s1024-z2-compile", "ds_configs/zero2.json",
             _speed("gpt2-124m", 1024, 256, 16, 2, 8, "raw", "/tmp/s21/gpt2-124m-seq1024-z2-1gpu-raw-compile",
                    "train.compile=torch"),
             1, H200_GIB, "bench/results/fp8_compile.md"),
    # moe.md run s39 (1 H100): the Qwen3-30B-A3B shape with 3 layers, seq 4096, micro 8 (--tune m8), ZeRO-2 and 3
    Workload("moe-qwen3-30b-a3b-l3-z2-m8", "ds_configs/zero2.json",
             _speed("qwen3-30b-a3b", 4096, 160, 8, 4, 5, "raw",
                    "/root/out/s/qwen3-30b-a3b-l3-seq4096-z2-1gpu-raw-m8", "model.num_layers=3"),
             1, H100_GIB, "bench/results/moe.md"),
    Workload("moe-qwen3-30b-a3b-l3-z3-m8", "ds_configs/zero3.json",
             _speed("qwen3-30b-a3b", 4096, 160, 8, 4, 5, "raw",
                    "/root/out/s/qwen3-30b-a3b-l3-seq4096-z3-1gpu-raw-m8", "model.num_layers=3"),
             1, H100_GIB, "bench/results/moe.md"),
    # moe.md run s56 (2 H200s): ZeRO-3 with DeepSpeed's AutoEP (speed.py --tune autoep-m8: a generated DS JSON)
    Workload("moe-qwen3-30b-a3b-l3-z3-autoep-2gpu", AUTOEP_2GPU,
             _speed("qwen3-30b-a3b", 4096, 160, 8, 2, 5, "raw",
                    "/root/out/x/s56moe/s/moe/qwen3-30b-a3b-l3-seq4096-z3-2gpu-raw-autoep-m8", "model.num_layers=3"),
             2, H200_GIB, "bench/results/moe.md"),
    # long_seq/README.md run s46 (1 H200 capped at 77 GiB, 125 GiB host): llama-3.2-1b full fine-tune at 524,288
    Workload("long-llama3.2-1b-z2-512k", PLAN_ZERO2,
             "model.name=llama-3.2-1b data.seq_len=524288 data.num_samples=3 train.micro_batch_size=1 "
             f"train.grad_accum=1 train.max_steps=2 {PLAN_COMMON} lora.enabled=false model.liger_fused_loss=auto "
             "train.run_dir=/root/out/cal/runs/ls-1b-z2-512k train.plan=/root/out/cal/plans/ls-1b-z2-512k.json "
             "model.tiled_mlp=true model.rope_factor=8 model.activation_offload=auto memory.gpu_limit_gib=77 "
             "train.precision=bf16",
             1, H200_GIB, "bench/results/long_seq/README.md", host_gib=125.0),
    # long_seq/README.md run s45 (same machine): the whole Llama-3-8B shape with LoRA at 393,216
    Workload("long-llama3.1-8b-lora-384k", PLAN_ZERO2,
             "model.name=llama-3.1-8b data.seq_len=393216 data.num_samples=2 train.micro_batch_size=1 "
             f"train.grad_accum=1 train.max_steps=1 {PLAN_COMMON} lora.enabled=true model.liger_fused_loss=auto "
             "train.run_dir=/root/out/cal/runs/ls-8b-lora-384k train.plan=/root/out/cal/plans/ls-8b-lora-384k.json "
             "model.tiled_mlp=true model.rope_factor=8 model.activation_offload=auto memory.gpu_limit_gib=77 "
             "train.precision=bf16",
             1, H200_GIB, "bench/results/long_seq/README.md", host_gib=125.0),
    # sequence_parallel/README.md run s40 (2 H200s; bench/multi_gpu_rows.sh sp): llama-3.2-1b at 16,384, SP=2
    Workload("sp2-llama3.2-1b-16k", "ds_configs/zero2.json",
             "train.path=raw model.name=llama-3.2-1b data.seq_len=16384 data.num_samples=40 train.micro_batch_size=1 "
             "train.grad_accum=1 train.max_steps=20 train.precision=bf16 train.export=false train.warmup_steps=2 "
             "train.lr=1e-4 train.log_every=1 train.sequence_parallel=2 train.run_dir=OUT/s/sp2",
             2, H200_GIB, "bench/results/sequence_parallel/README.md"),
    # sequence_parallel/README.md run s58 (2 H100s, each capped at 24 GiB; bench/max_seq_probe.py): LoRA, SP=2,
    # the longest length trained, 335,872
    Workload("sp2-llama3.2-1b-lora-336k", PLAN_ZERO2,
             "model.name=llama-3.2-1b data.seq_len=335872 data.num_samples=2 train.micro_batch_size=1 "
             f"train.grad_accum=1 train.max_steps=1 {PLAN_COMMON} lora.enabled=true model.liger_fused_loss=auto "
             "train.run_dir=runs/p2/runs/probe-sp2-335872 train.plan=runs/p2/plans/probe-sp2-335872.json "
             "model.tiled_mlp=true model.rope_factor=8 model.activation_offload=false memory.gpu_limit_gib=24 "
             "train.sequence_parallel=2 train.precision=bf16",
             2, H100_GIB, "bench/results/sequence_parallel/README.md"),
)


def _load_tree(tree: Path) -> None:
    """Import `toolkit` from tree, and only from there."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p not in ("", here)]  # bench/'s own modules (attention.py, ...) stay out
    sys.path.insert(0, str(tree.resolve()))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # deepspeed, if imported here, picks no CUDA accelerator
    import toolkit

    where = Path(toolkit.__file__).resolve()
    if tree.resolve() not in where.parents:
        raise SystemExit(f"error: toolkit imported from {where}, not from {tree}")
    # what the decisions import, loaded before any patch so their module state is the unpatched one
    import toolkit.runtime.loop

    import toolkit.runtime.spec


def _stub_data(overrides: list[str], tmp: Path) -> list[str]:
    """data.source=FILE -> a one-row stub of FILE's name in tmp: the decisions read the settings, not the rows."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "data.source" and value != "synthetic":
            stub = tmp / Path(value).name
            row = {"text": "a document"} if stub.stem == "docs" else {"prompt": "a question", "response": "an answer"}
            stub.write_text(json.dumps(row) + "\n")
            o = f"data.source={stub}"
        out.append(o)
    return out


@contextlib.contextmanager
def _as_on(w: Workload) -> Iterator[None]:
    """The machine queries of the decisions, answered as on the row's machine (rank 0 of w.world_size, one host)."""
    import torch

    from toolkit.launch import dist
    from toolkit.runtime import fp8, kernels
    from toolkit.runtime.attention import kernels as attention_kernels
    from toolkit.runtime.sequence import offload

    card = int(w.card_gib * GIB)
    limit = min(card, int(w.gpu_limit_gib * GIB)) if w.gpu_limit_gib > 0 else None  # dist.limit_gpu_memory

    def gpu_memory_bytes(context_bytes: int = 0) -> int:  # dist.gpu_memory_bytes on that card
        return card if limit is None else min(card, limit + context_bytes)

    env = {"WORLD_SIZE": str(w.world_size), "LOCAL_SIZE": str(w.world_size), "LOCAL_WORLD_SIZE": str(w.world_size),
           "RANK": "0", "LOCAL_RANK": "0"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(torch.cuda, "is_available", return_value=True))
        stack.enter_context(mock.patch.object(torch.cuda, "is_bf16_supported", return_value=True))
        stack.enter_context(mock.patch.object(dist, "on_cpu", return_value=False))
        stack.enter_context(mock.patch.object(dist, "gpu_memory_bytes", gpu_memory_bytes))
        stack.enter_context(mock.patch.object(attention_kernels, "varlen_available", return_value=True))
        stack.enter_context(mock.patch.object(kernels, "supported_model_types", return_value=LIGER_MODEL_TYPES))
        stack.enter_context(mock.patch.object(offload, "host_memory_bytes", return_value=w.host_gib * GIB))
        stack.enter_context(mock.patch.object(fp8, "_capability", return_value=SM90))
        yield


def _spec(w: Workload, tmp: Path) -> Any:
    """toolkit/train.py up to the RunSpec: load_config, train.ds_config, read_inputs (world from w), build_spec."""
    from toolkit.config.ds_config import load_ds_config
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import model_config
    from toolkit.runtime.spec import RunInputs, build_spec

    cfg = load_config(None, _stub_data(w.override_list, tmp))
    if isinstance(w.ds, dict):
        path = tmp / f"{w.name}.ds.json"
        path.write_text(json.dumps(w.ds, indent=1))
        cfg.train.ds_config = str(path)
    else:
        cfg.train.ds_config = str(Path.cwd() / w.ds)
    return build_spec(RunInputs(cfg, load_ds_config(cfg.train.ds_config), model_config(cfg), w.world_size))


def decide(w: Workload, tmp: Path) -> dict[str, Any]:
    """loop.run()'s decisions before the run directory, and _run()'s (_offload_plan, _tile_loss), for one row."""
    import torch
    from toolkit.runtime.loop import _offload_plan

    from toolkit.config.ds_config import ConfigError, zero_stage
    from toolkit.config.schema import packing
    from toolkit.plan.speedups import tiled_loss_tile
    from toolkit.runtime import attention, kernels, moe
    from toolkit.runtime import compile as compiling
    from toolkit.runtime.attention.kernels import varlen_available
    from toolkit.runtime.sequence import tiling

    with _as_on(w):
        p = _spec(w, tmp)
        cfg, stage = p.cfg, zero_stage(p.ds)
        compiled, compile_why = compiling.decide(cfg, p.ds, stage, p.total_steps, bool(p.fp8))
        tiled, _ = tiling.decide(cfg.model.tiled_mlp, cfg.data.seq_len, cfg.train.sequence_parallel)
        if tiled and compiled and cfg.train.compile == "auto":
            compiled, compile_why = False, ("train.compile=auto with tiled MLPs: their compiled speed is not measured "
                                            "yet; train.compile=torch compiles")
        if compiled and stage == 3:
            compiling.plain_linear(p.ds)  # sets memory_efficient_linear in the dict the MoE fused-loss rule reads
        liger = kernels.choice_for(cfg, p.model_config.model_type, stage, compiled,
                                   moe.fused_loss_setting(cfg, p.model_config, p.ds, p.world_size, compiled))
        try:
            experts_path = moe.choose_path(cfg, p.model_config, liger)
        except ConfigError as e:
            raise SystemExit(f"error: {w.name}: the run would stop: {e}") from None
        if experts_path is not None:
            liger = moe.with_experts(liger, experts_path, p.model_config.model_type)
        cuda = torch.cuda.is_available() and not _on_cpu()  # attention.for_run's arguments to plan()
        attn = attention.plan(cfg.model.attn_implementation, cfg.model.task, packing(cfg)[0], cuda,
                              cuda and varlen_available(torch.device("cuda")), cfg.train.sequence_parallel)
        offloading = _offload_plan(p)
        loss_on, _ = tiling.loss_decide(cfg.model.tiled_loss,
                                        fused_loss=bool(liger.kwargs.get("fused_linear_cross_entropy")),
                                        tokens=cfg.data.seq_len // cfg.train.sequence_parallel,
                                        causal_lm=cfg.model.task == "causal_lm", moe=moe.is_moe(p.model_config))
        return {
            "stage": stage, "precision": p.precision, "fp8": p.fp8, "adapter_autocast": bool(p.adapter_autocast),
            "packing": packing(cfg)[0],
            "attention": {"implementation": attn.implementation, "boundaries": attn.boundaries,
                          "whole_rows": attn.whole_rows, "note": attn.note},
            "compile": compiled, "compile_why": compile_why, "tiled_mlp": tiled, "tiled_loss": loss_on,
            "tiled_loss_tile": tiled_loss_tile(p.model_config.vocab_size) if loss_on else None,
            "liger_kwargs": dict(liger.kwargs), "liger_reason": liger.reason,
            "experts_path": experts_path.describe() if experts_path is not None else None,
            "activation_offload": {"on": offloading.on, "pinned": offloading.pinned if offloading.on else None},
        }


def _on_cpu() -> bool:
    from toolkit.launch import dist

    return dist.on_cpu()


def record(w: Workload, tmp: Path) -> dict[str, Any]:
    return {"name": w.name, "ds": copy.deepcopy(w.ds), "overrides": w.override_list, "world_size": w.world_size,
            "gpu_gib": w.gpu_gib, "host_gib": w.host_gib, "page": w.page, "decided": decide(w, tmp)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", required=True, type=Path, help="the toolkit checkout whose decisions to record")
    ap.add_argument("-o", "--out", required=True, type=Path, help="the JSON fixture to write")
    ap.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    _load_tree(a.tree)
    wanted = set(filter(None, a.only.split(",")))
    chosen = [w for w in WORKLOADS if not wanted or w.name in wanted]
    repo = Path(__file__).resolve().parents[1]
    os.chdir(repo)  # the ds_configs/ paths are the repo's
    with tempfile.TemporaryDirectory() as tmp:
        rows = [record(w, Path(tmp)) for w in chosen]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workloads": rows}, indent=1) + "\n")
    print(f"{len(rows)} workloads -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
