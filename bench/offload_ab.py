"""Checkpointed layer inputs in host memory, four ways, on one GPU (issue 35: "DeepSpeed's context or transformers'
checkpointing offload: measure both"). One process, the Llama-3.2-1B shape (16 layers, hidden 2048) in bf16 from
its config, non-reentrant checkpointing per layer, one sequence; a forward and backward of the decoder (the loss
is the mean square of its last hidden state: no vocabulary, so the peak is the layers'):

- none: plain checkpointing, every layer input stays on the GPU;
- toolkit-pinned / toolkit-pageable: model.activation_offload (toolkit/runtime/sequence/offload.py);
- deepspeed: DeepSpeed's CheckpointHiddenStatesOffload as it ships (pinned);
- transformers: transformers' checkpointing offload (`offload=True`: each layer's checkpoint under
  torch.autograd.graph.save_on_cpu(pin_memory=True)); where the installed transformers lacks it, the same
  wrapping by hand (the JSON says which).

    python bench/offload_ab.py --out OUT/offload_ab.json [--seqs 65536,131072] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

VARIANTS = ("none", "toolkit-pinned", "toolkit-pageable", "deepspeed", "transformers")


def build(seq: int, variant: str) -> tuple[torch.nn.Module, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq, use_cache=False,
                      rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    how = "gradient_checkpointing_enable"
    if variant == "transformers":
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None and "offload" in inspect.signature(enable).parameters:
            enable({"use_reentrant": False}, offload=True)
            how = "activation_checkpointing_enable(offload=True)"
        else:  # what that option does (transformers#48444), by hand
            from torch.autograd.graph import save_on_cpu
            from torch.utils.checkpoint import checkpoint

            def offloaded(function: Any, *args: Any, **kwargs: Any) -> Any:
                with save_on_cpu(pin_memory=True, device_type="cuda"):
                    return checkpoint(function, *args, **kwargs)

            model._set_gradient_checkpointing(True, functools.partial(offloaded, use_reentrant=False))
            how = "save_on_cpu(pin_memory=True) around each layer's checkpoint, by hand"
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, how


def context(variant: str) -> Any:
    from toolkit.runtime.sequence import offload

    if variant.startswith("toolkit-"):
        return offload._offload_class()(use_pin_memory=variant == "toolkit-pinned", max_fwd_stash_count=0)
    if variant == "deepspeed":
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            CheckpointHiddenStatesOffload,
        )

        return CheckpointHiddenStatesOffload(use_pin_memory=True)
    return None


def step(model: torch.nn.Module, ids: torch.Tensor, ctx: Any) -> tuple[float, float]:
    """(seconds, peak GiB above what was allocated before) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with ctx if ctx is not None else contextlib.nullcontext():
        hidden = model.model(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", default="65536,131072")
    ap.add_argument("--repeat", type=int, default=2, help="timed steps after one warm-up step")
    a = ap.parse_args()
    import transformers

    rows = []
    for seq in (int(s) for s in a.seqs.split(",")):
        for variant in VARIANTS:
            model, how = build(seq, variant)
            ids = torch.randint(0, 32000, (1, seq), device="cuda")
            ctx = context(variant)
            step(model, ids, ctx)
            runs = [step(model, ids, ctx) for _ in range(a.repeat)]
            row = {"seq": seq, "variant": variant, "how": how, "step_s": statistics.median(r[0] for r in runs),
                   "peak_gib": max(r[1] for r in runs), "layer_input_gib": 2 * 2048 * seq / 2**30}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model, ctx, ids
            torch.cuda.empty_cache()
    for r in rows:
        ref = next(x for x in rows if x["seq"] == r["seq"] and x["variant"] == "none")
        r["saved_gib"] = ref["peak_gib"] - r["peak_gib"]
        r["saved_layer_inputs"] = r["saved_gib"] / r["layer_input_gib"]
        r["time_vs_none"] = r["step_s"] / ref["step_s"]
    doc = {"command": "python bench/offload_ab.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("| seq | variant | step s | x none | peak GiB | saved GiB | saved layer inputs |")
    for r in rows:
        print(f"| {r['seq']} | {r['variant']} | {r['step_s']:.2f} | {r['time_vs_none']:.2f} | {r['peak_gib']:.2f} | "
              f"{r['saved_gib']:.2f} | {r['saved_layer_inputs']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
