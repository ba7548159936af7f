"""Attention alone, forward + backward of one llama-1b layer's attention (32 query / 8 kv heads, dim 64, bf16):
which kernel the toolkit should use for packed and for unpacked causal rows.

    python bench/attention.py --out OUT.json      # one CUDA GPU; a table on stdout
    python bench/attention.py --rates --out OUT.json   # the planner's attention rates (toolkit/plan/attention_rates.json)
    python bench/attention.py --rates --shapes 4:1:256,8:4:256 [--window 512] --out OUT.json   # some shapes only;
        --window: sdpa as transformers calls it for a sliding-window layer (a boolean mask, kv heads repeated)

Per shape (micro-batch x sequence): sdpa as transformers calls it (GQA through enable_gqa, no mask), sdpa
forced to each backend (kv heads repeated, so cuDNN can take it), sdpa with the block-diagonal mask that
packed rows get from transformers, the toolkit's attention function on packed rows (torch varlen_attn) for
documents of about 120 and 1,500 tokens. Median of 20 timed calls after 5 warm-ups, CUDA events.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHAPES = ((16, 2048), (4, 8192), (1, 32768))
HEADS, KV, DIM = 32, 8, 64


def _time(fn: Any, reps: int = 20, warmups: int | None = None) -> float:
    """Median milliseconds of `reps` calls after `warmups` (5, or 1 for fewer than 10 reps), CUDA events."""
    for _ in range((5 if reps >= 10 else 1) if warmups is None else warmups):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _docs(total: int, mean: int, width: int, rng: random.Random) -> list[list[int]]:
    """Rows of `width` filled with documents of lengths around `mean` (uniform in [mean/4, 7 mean/4])."""
    rows = []
    for _ in range(total // width):
        lens, left = [], width
        while left > 0:
            n = min(left, max(2, int(rng.uniform(mean / 4, 7 * mean / 4))))
            lens.append(n)
            left -= n
        rows.append(lens)
    return rows


def _measure(b: int, s: int, rng: random.Random) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from toolkit.runtime.attention import kernels
    from toolkit.runtime.attention.interface import attention_forward
    from toolkit.runtime.data.batches import document_boundaries

    dev = torch.device("cuda")
    module = torch.nn.Module().train()
    q = torch.randn(b, HEADS, s, DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, KV, s, DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, KV, s, DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, HEADS, s, DIM, device=dev, dtype=torch.bfloat16)
    rep = HEADS // KV

    def step(f: Any) -> Any:
        def run() -> None:
            out = f()
            (out if out.shape == g.shape else out.transpose(1, 2)).backward(g)
        return run

    def forced(name: str) -> Any:
        with sdpa_kernel(getattr(SDPBackend, name)):
            return sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)

    def repeated(kw: dict[str, Any]) -> Any:  # the varlen path as it runs where the kernel cannot take GQA
        mode, kernels.GQA = kernels.GQA, "repeat"
        try:
            return attention_forward(module, q, k, v, None, scaling=DIM ** -0.5, **kw)[0]
        finally:
            kernels.GQA = mode

    cases: dict[str, Any] = {"sdpa as transformers calls it (enable_gqa)":
                             step(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        cases[f"sdpa {name.split('_')[0].lower()}, kv repeated"] = step(lambda name=name: forced(name))
    if b * s <= 16 * 2048:
        lens = _docs(b * s, 120, s, rng)
        seg = torch.tensor([i for i, row in enumerate(lens) for n in row for _ in range(n)], device=dev).view(b, s)
        pos = torch.cat([torch.arange(n) for row in lens for n in row]).to(dev).view(b, s)
        mask = ((seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :]))[:, None]
        cases["sdpa + block-diagonal mask (docs ~120)"] = step(
            lambda: sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask))
    for mean in (120, 1500):
        kw = document_boundaries(_docs(b * s, mean, s, rng), s)
        kw = {name: (x.to(dev) if isinstance(x, torch.Tensor) else x) for name, x in kw.items()}
        cases[f"toolkit varlen (docs ~{mean})"] = step(
            lambda kw=kw: attention_forward(module, q, k, v, None, scaling=DIM ** -0.5, **kw)[0])
        cases[f"toolkit varlen, kv heads repeated (docs ~{mean})"] = step(lambda kw=kw: repeated(kw))
    rows = []
    for name, fn in cases.items():
        try:
            rows.append({"shape": f"{b} x {s}", "case": name, "ms": round(_time(fn), 3)})
        except Exception as e:  # a backend that refuses a shape is a finding, not a crash
            rows.append({"shape": f"{b} x {s}", "case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    return rows


# --rates: causal attention as transformers calls sdpa on unpacked rows (enable_gqa, is_causal), forward and forward +
# backward, per (query heads, kv heads, head dim) of the shapes the planner knows, over lengths: the table behind
# toolkit/plan/attention_rates.json. Tokens per call: at least RATE_TOKENS (micro-batches of shorter rows).
RATE_HEADS = ((32, 8, 64), (14, 2, 64), (12, 2, 128), (16, 2, 128), (32, 8, 128), (32, 32, 128), (4, 1, 256), (8, 4, 256),
              (16, 8, 256))
RATE_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
RATE_TOKENS = 32768
RATE_MAX_WIDTH_AT = {262144: 2048}  # heads x dim measured at this length only up to this width (device time)


def _rate(heads: int, kv: int, dim: int, s: int, window: int = 0) -> dict[str, Any]:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev, b = torch.device("cuda"), max(1, RATE_TOKENS // s)
    q = torch.randn(b, heads, s, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, s, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, s, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, heads, s, dim, device=dev, dtype=torch.bfloat16)
    mask = None
    if window:  # transformers' sdpa_attention_forward with a mask: no enable_gqa, the kv heads repeated first
        i = torch.arange(s, device=dev)
        mask = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window))[None, None]

    def fwd() -> Any:
        if mask is not None:
            rep = heads // kv
            return sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
        return sdpa(q, k, v, is_causal=True, enable_gqa=kv != heads)

    def both() -> None:
        fwd().backward(g)

    reps = 20 if s <= 16384 else 3
    with torch.no_grad():
        ms_f = _time(fwd, reps)
    ms_b = _time(both, reps)
    full = 4.0 * heads * dim * s * b * s  # forward, causal counted as full
    return {"heads": heads, "kv_heads": kv, "head_dim": dim, "seq": s, "micro": b, **({"window": window} if window else {}),
            "fwd_ms": round(ms_f, 3), "fwd_bwd_ms": round(ms_b, 3),
            "fwd_tflops": round(full / ms_f / 1e9, 1), "fwd_bwd_tflops": round(3 * full / ms_b / 1e9, 1)}


def _rates(shapes: tuple[tuple[int, int, int], ...] = RATE_HEADS, window: int = 0) -> list[dict[str, Any]]:
    """Per shape and length: ms of one layer's attention forward and forward + backward, and the rate in the planner's
    own FLOP count (12 x heads x head_dim x length a token for forward + backward, 4 x for forward: causal work
    counted as full, as toolkit/observe/metrics.py counts it; a sliding window's too, so its rate says what the
    planner's count costs there). A masked row holds a boolean mask of length squared: measured up to 32K."""
    rows = []
    for heads, kv, dim in shapes:
        for s in RATE_LENGTHS:
            if heads * dim <= RATE_MAX_WIDTH_AT.get(s, 1 << 30) and (not window or s <= 32768):
                rows.append(_rate(heads, kv, dim, s, window))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rates", action="store_true", help="the planner's rate table (RATE_HEADS x RATE_LENGTHS)")
    p.add_argument("--shapes", default="", help="--rates: these query:kv:head_dim shapes only, comma-separated")
    p.add_argument("--window", type=int, default=0, help="--rates: a sliding window of this many tokens (masked)")
    args = p.parse_args()
    from toolkit.runtime.attention.kernels import prepare

    gqa = prepare(torch.device("cuda"))  # what a training run decides before its first forward
    rng = random.Random(0)
    shapes = tuple(tuple(int(x) for x in t.split(":")) for t in args.shapes.split(",") if t) or RATE_HEADS
    rows = _rates(shapes, args.window) if args.rates else [r for b, s in SHAPES for r in _measure(b, s, rng)]
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "varlen_kv_heads": gqa, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
