"""Liger's fused linear cross-entropy alone, forward + backward, by chunk budget: what the loss costs a micro-step
and how many chunks it should walk.

    python bench/fused_loss.py --out OUT.json        # one CUDA GPU; a table on stdout

Liger splits a micro-batch's BT tokens into chunks of next_pow2(BT / ceil(V / (C x H))) rows (C: its
`chunk_mem_const`, 1 by default on Hopper), so it walks about V / H chunks whatever BT is, and each chunk reads the
head's V x H weight twice and reads and writes its gradient once: a cost that grows with V^2 and not with the
tokens. Per shape (hidden H, vocabulary V) and tokens BT: the median time of a forward and backward at each C, the
transient memory above the inputs, and, for scale, three bf16 matmuls of the same FLOPs at one large chunk (the
compute-bound time). Median of 5 timed calls after 2 warm-ups, CUDA events.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# (name, hidden, vocabulary): the families the planner's rows ran
SHAPES = (("gemma3-1b", 1152, 262144), ("qwen2.5-1.5b", 1536, 151936), ("llama-1b", 2048, 128256),
          ("qwen3-4b", 2560, 151936), ("phi3-mini", 3072, 32064), ("llama-3-8b", 4096, 128256))
TOKENS = (2048, 4096, 8192, 16384, 32768, 65536)
BUDGETS = (1, 2, 4, 8, 16, 32)


def _time(fn: Any) -> float:
    """Median seconds of 5 calls after 2 warm-ups (bench/attention.py's timer)."""
    from attention import _time as median_ms  # bench/attention.py: this script's directory is on sys.path

    return median_ms(fn, reps=5, warmups=2) / 1e3


def chunks(bt: int, h: int, v: int, c: int) -> tuple[int, int]:
    """(chunk rows, chunks) as liger_kernel/ops/fused_linear_cross_entropy.py computes them."""
    inc = -(-v // (c * h))
    size = min(1 << max(0, (-(-bt // inc) - 1).bit_length()), bt)
    return size, -(-bt // size)


def measure(h: int, v: int, bt: int) -> list[dict[str, Any]]:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dev = torch.device("cuda")
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    x = torch.randn(bt, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (bt,), device=dev)
    rows = []
    # compute-bound reference: the three matmuls (logits, the input's gradient, the weight's) on 4,096-row pieces
    piece = min(bt, 4096)
    xp, g = x.detach()[:piece], torch.randn(piece, v, device=dev, dtype=torch.bfloat16)
    wd = w.detach()
    mm = _time(lambda: (xp @ wd.t(), g @ wd, g.t() @ xp)) * bt / piece
    for c in BUDGETS:
        size, n = chunks(bt, h, v, c)
        if c > 1 and size == chunks(bt, h, v, c // 2)[0]:
            continue  # the same chunks as the budget before

        def step(c: int = c) -> None:
            x.grad = w.grad = None
            liger_fused_linear_cross_entropy(x, w, y, chunk_mem_const=c).backward()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = _time(step)
        peak = torch.cuda.max_memory_allocated() - base
        rows.append({"hidden": h, "vocab": v, "tokens": bt, "chunk_mem_const": c, "chunk_rows": size, "chunks": n,
                     "s": round(t, 6), "matmuls_s": round(mm, 6), "transient_gib": round(peak / 2**30, 3),
                     "tflops": round(6.0 * bt * h * v / t / 1e12, 1)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    for name, h, v in SHAPES:
        for bt in TOKENS:
            for r in measure(h, v, bt):
                rows.append({"shape": name, **r})
                print(f"{name:13s} BT {bt:6d} C {r['chunk_mem_const']:2d}: {r['chunks']:4d} x {r['chunk_rows']:5d}  "
                      f"{r['s'] * 1e3:8.2f} ms  (matmuls {r['matmuls_s'] * 1e3:7.2f})  {r['tflops']:6.1f} TFLOP/s  "
                      f"+{r['transient_gib']:.2f} GiB", flush=True)
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                       "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
