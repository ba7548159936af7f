"""Baseline: a bare `deepspeed.initialize` training loop, written by hand from the DeepSpeed / HF docs.

Imports nothing from `toolkit`. Random-init causal LM, random full-length token ids, plain ZeRO JSON:

    deepspeed --num_gpus G --master_port P bench/bare_loop.py --model llama-1b --seq 2048 --micro 4 \
        --global-batch 64 --stage 3 --offload none --warmup 3 --steps 10 --out result.json

CPU smoke test (gloo, fp32): prefix with `DS_ACCELERATOR=cpu` and use `--model tiny`.
`--liger`: Liger's kernels applied to the model the way its README shows (what a user tuning by hand adds;
bench/speed.py's `bare-tuned` variant runs it at the fastest micro-batch measured for it).
Rank 0 writes the result JSON (step times of the timed steps, losses of all steps, memory peaks).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import deepspeed
import psutil
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations import HfDeepSpeedConfig

# The toolkit's presets (toolkit/runtime/model.py PRESETS), repeated on purpose: a baseline imports nothing from
# toolkit/. tests/dist/test_bench_speed.py runs both sides on the tiny shape.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=False),
    "gpt2-124m": dict(model_type="gpt2", vocab_size=50304, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    # Mixture-of-Experts: transformers' default experts path (grouped_mm); bench/speed.py runs it with --layers
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, max_position_embeddings=40960, rope_theta=1_000_000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def model_config(name: str, layers: int = 0) -> PretrainedConfig:
    kw = dict(MODELS[name])
    if layers:  # full width, fewer decoder layers (a large shape on one GPU)
        kw["n_layer" if "n_layer" in kw else "num_hidden_layers"] = layers
    return CONFIG_MAPPING[kw.pop("model_type")](**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def ds_config(args: argparse.Namespace, grad_accum: int, bf16: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": 5e8}
    if args.stage in (1, 2):
        zero["allgather_bucket_size"] = 5e8
    if args.stage == 3:
        zero.update(stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5,
                    stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9)
    if args.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step, all ranks")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    p.add_argument("--offload", choices=["none", "optimizer"], default="none")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the model's own)")
    p.add_argument("--liger", action="store_true", help="Liger kernels on the model (RMSNorm, SwiGLU, RoPE, fused loss)")
    p.add_argument("--local_rank", type=int, default=-1, help="appended by the launcher; LOCAL_RANK is used")
    return p.parse_args()


def start(args: argparse.Namespace) -> tuple[bool, torch.device, int, int]:
    """Device and process group; returns (cpu, device, rank, grad_accum). Shared with hf_trainer.py."""
    cpu = get_accelerator().device_name() == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not cpu:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    world = dist.get_world_size()
    grad_accum, rem = divmod(args.global_batch, args.micro * world)
    if rem or grad_accum < 1:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of micro*world={args.micro * world}")
    return cpu, device, dist.get_rank(), grad_accum


def write_result(args: argparse.Namespace, variant: str, device: torch.device, grad_accum: int,
                 step_times: list[float], losses: list[float], n_params: int, config: PretrainedConfig) -> None:
    """Collective: peaks over ranks (MAX), then rank 0 writes the result JSON. Shared with hf_trainer.py."""
    cpu = device.type == "cpu"
    peak = 0.0 if cpu else torch.cuda.max_memory_allocated() / 2**30
    stats = torch.tensor([peak, psutil.Process().memory_info().rss / 2**30], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    result = {
        "variant": variant, "model": args.model, "seq": args.seq, "stage": args.stage,
        "offload": args.offload, "gpus": dist.get_world_size(), "micro_batch": args.micro, "grad_accum": grad_accum,
        "tokens_per_step": args.global_batch * args.seq, "step_times_s": step_times, "losses": losses,
        "n_params": n_params, "n_layers": getattr(config, "num_hidden_layers", None) or config.n_layer, "hidden": config.hidden_size,
        "peak_allocated_gib": None if cpu else stats[0].item(), "host_rss_gib": stats[1].item(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    args = parse_args()
    cpu, device, rank, grad_accum = start(args)

    cfg = ds_config(args, grad_accum, bf16=not cpu)
    dschf = HfDeepSpeedConfig(cfg) if args.stage == 3 else None  # alive => from_config partitions (zero.Init)
    config = model_config(args.model, args.layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if args.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    gen = torch.Generator().manual_seed(1234 + rank)
    total = args.warmup + args.steps
    batches = torch.randint(4, config.vocab_size, (total, grad_accum, args.micro, args.seq), generator=gen)
    if not cpu:
        batches = batches.pin_memory()

    losses: list[float] = []
    step_times: list[float] = []
    for step in range(total):
        if not cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in batches[step]:
            x = x.to(device, non_blocking=True)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        if not cpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= args.warmup:
            step_times.append(dt)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.4f} time {dt:.3f}s", flush=True)

    write_result(args, "bare-tuned" if args.liger else "bare", device, grad_accum, step_times, losses, n_params, config)
    engine.destroy()
    del dschf
    dist.barrier()


if __name__ == "__main__":
    main()
