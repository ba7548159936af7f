"""ZeRO-3 leaf modules and gradients: the same model, data and seed under four leaf settings.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/zero3_leaf.py   (2 CPU ranks, gloo, fp32; ~1 minute)

Rows: no leaf modules; decoder layers as leaves (`set_z3_leaf_modules`, as DeepSpeed's docs show);
`stage3_module_granularity_threshold` at 6000 and at 1e9, which DeepSpeed resolves parent-first to the
backbone (LlamaModel) and to the whole model. Prints each row's losses and global gradient norms over
3 steps; the leaf rows should equal the first. Imports nothing from toolkit/ (it shows DeepSpeed's own
behaviour, which toolkit.runtime.model.check_zero3_leaves guards against).

DeepSpeed 0.19.8's leaf path calls `Tensor.record_stream` on gradients in zero_grad, which CPU tensors
reject ("unknown parameter type"); streams do not exist on the CPU, so it is made a no-op for them here.
"""

from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

_record_stream = torch.Tensor.record_stream
torch.Tensor.record_stream = lambda t, s: None if t.device.type == "cpu" else _record_stream(t, s)  # type: ignore[method-assign]

ROWS = [("none", 0, False), ("decoder layers", 0, True), ("threshold 6000", 6000, False),
        ("threshold 1e9", 10**9, False)]


def run(threshold: int, decoder_leaves: bool) -> tuple[list[str], list[tuple[float, float]]]:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_module_granularity_threshold": threshold}}
    keep = HfDeepSpeedConfig(cfg)  # alive: the model is built partitioned (zero.Init)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    if decoder_leaves:
        set_z3_leaf_modules(model, [LlamaDecoderLayer])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    leaves = [type(m).__name__ for m in get_z3_leaf_modules(model)]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    out = []
    for _ in range(3):
        x = torch.randint(0, 1000, (2, 32), generator=gen)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), float(engine.get_global_grad_norm())))
    del engine, keep
    return leaves, out


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    lines = ["| leaf setting | leaf modules DeepSpeed marked | losses, steps 1-3 | gradient norms, steps 1-3 |",
             "|---|---|---|---|"]
    for name, threshold, decoder in ROWS:
        leaves, out = run(threshold, decoder)
        shown = f"{len(leaves)} x {leaves[0]}" if leaves else "none"
        lines.append(f"| {name} | {shown} | {' '.join(f'{lo:.5f}' for lo, _ in out)} | "
                     f"{' '.join(f'{g:.5f}' for _, g in out)} |")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # as toolkit.launch.dist.exit_process: gloo's leftover threads can abort interpreter finalization


if __name__ == "__main__":
    main()
