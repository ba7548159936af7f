"""One MoE layer's experts alone, forward + backward: which experts path the toolkit should run.

    python bench/experts.py --out OUT.json      # one CUDA GPU; a table on stdout

The Qwen3-30B-A3B shape (128 experts of intermediate 768, hidden 2048, top-8), bf16 weights, 8,192 tokens (micro 2
x seq 4096) routed by softmax-top-k of random logits. Per path: transformers' experts implementations (`eager`,
`grouped_mm`, `batched_mm`), Liger's fused MoE (`LigerExperts`, what Liger's swiglu patch puts in place), and
`grouped_mm` under torch.compile. Each path's output and gradients are compared with eager's in fp32 (the
reference); median of 10 timed calls after 3 warm-ups (Liger autotunes in its first calls), CUDA events.
A path slower than --skip-after ms in its warm-ups is timed from those (batched_mm did not finish in minutes
on the full shape in plain transformers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 8192, 2048, 768, 128, 8


def _experts(impl: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, num_hidden_layers=1)
    cfg._experts_implementation = "grouped_mm" if impl in ("liger", "grouped_mm+compile") else impl
    torch.manual_seed(0)
    m = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    if impl == "liger":
        from liger_kernel.transformers.swiglu import LigerExperts

        m.forward = LigerExperts.forward.__get__(m)  # what Liger's _patch_swiglu_module binds
    return m


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(dtype)
    probs = torch.softmax(torch.randn(TOKENS, EXPERTS, device="cuda", generator=g), dim=-1)
    w, idx = torch.topk(probs, TOP_K, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def _run(m: torch.nn.Module, fwd: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
         grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    out = fwd(x, idx, w)
    out.backward(grad)
    return out.detach(), [x.grad, *(p.grad for p in m.parameters())]


def _measure(impl: str, ref: tuple[torch.Tensor, list[torch.Tensor]], skip_after_ms: float) -> dict[str, Any]:
    m = _experts(impl).cuda().to(torch.bfloat16)
    fwd = torch.compile(m) if impl == "grouped_mm+compile" else m
    x, idx, w = _inputs(torch.bfloat16)
    grad = torch.ones(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16) / TOKENS
    row: dict[str, Any] = {"path": impl}
    try:
        t0 = time.perf_counter()
        out, grads = _run(m, fwd, x, idx, w, grad)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        # correctness: bf16 against the fp32 eager reference, relative to the reference's scale
        errs = [((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                for a, b in zip([out, *grads], [ref[0], *ref[1]], strict=True)]
        row["max_rel_err"] = round(max(errs), 5)
        times = []
        for i in range(13):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _run(m, fwd, x, idx, w, grad)
            b.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
            elif a.elapsed_time(b) > skip_after_ms:
                times.append(a.elapsed_time(b))
                row["note"] = f"over {skip_after_ms:.0f} ms a call: timed from {len(times)} call(s)"
                break
        row["fwd_bwd_ms"] = round(statistics.median(times), 2)
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except Exception as e:  # one path's failure is a row, not the end of the table
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del m, fwd
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--paths", default="eager,grouped_mm,liger,grouped_mm+compile,batched_mm")
    p.add_argument("--skip-after", type=float, default=2000.0, help="ms per call above which warm-ups are the timing")
    a = p.parse_args()
    ref_m = _experts("eager").cuda()
    x, idx, w = _inputs(torch.float32)
    ref = _run(ref_m, ref_m, x, idx, w, torch.ones(TOKENS, HIDDEN, device="cuda") / TOKENS)
    del ref_m
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # each path's peak its own, not the fp32 reference's
    import transformers

    # active FLOPs of the experts: top-k x 3 matmuls of hidden x intermediate per token, forward + backward = 3x
    flops = 3 * 2 * TOKENS * TOP_K * 3 * HIDDEN * INTER
    doc: dict[str, Any] = {"shape": dict(tokens=TOKENS, hidden=HIDDEN, intermediate=INTER, experts=EXPERTS, top_k=TOP_K),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "rows": []}
    rows = doc["rows"]
    for impl in a.paths.split(","):  # written after each path: a path that never returns leaves the others on record
        r = _measure(impl, ref, a.skip_after)
        if r.get("fwd_bwd_ms"):
            r["tflops"] = round(flops / (r["fwd_bwd_ms"] / 1e3) / 1e12, 1)
        rows.append(r)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print("| path | fwd+bwd ms | TFLOP/s | max rel err vs fp32 eager | peak GiB | first call s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r.get('fwd_bwd_ms', r.get('error', ''))} | {r.get('tflops', '')} | "
              f"{r.get('max_rel_err', '')} | {r.get('peak_gib', '')} | {r.get('first_call_s', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
