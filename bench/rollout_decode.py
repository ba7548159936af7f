"""Where a GRPO rollout's decode time goes (issue 49): the model a toolkit run trains (its attention, Liger's kernels)
against a plain transformers model, each with the toolkit's generate_local (per-row sampler) and with transformers'
own sampling, dynamic and static KV cache. One GPU, no DeepSpeed (the whole-model path generates without it):

    python bench/rollout_decode.py --model llama-1b --vocab 8192 --prompts 32 --prompt-len 128 --new 128 --out OUT.json

Each variant: one untimed call (the compile for a static cache), then one timed call; ms a decoding step = seconds /
new tokens a prompt. Random init, no stop token: every prompt runs to --new tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(name: str, vocab: int, liger: bool, toolkit_attention: bool, device: str) -> Any:
    import torch

    from toolkit.config.schema import load_config
    from toolkit.plan.liger import choose
    from toolkit.runtime.attention.interface import NAME, register
    from toolkit.runtime.model import build_model, model_config
    from toolkit.runtime.speed import kernels

    cfg = load_config(None, [f"model.name={name}"])
    mc = model_config(cfg)
    mc.vocab_size = vocab
    if toolkit_attention:
        register()
    model = build_model(cfg, mc, attn=NAME if toolkit_attention else "sdpa")
    choice = choose(liger, cuda=device == "cuda", model_type=mc.model_type, task="causal_lm", stage=0,
                    supported=kernels.supported_model_types())
    kernels.apply(model, choice)
    return model.to(torch.bfloat16).to(device).eval(), mc


def _generate(a: argparse.Namespace, kind: str, rest: list[str], cache: str, model: Any, mc: Any,
              prompts: list[list[int]]) -> None:
    import torch

    from toolkit.config.schema import EvalConfig
    from toolkit.runtime.generation.batched import generate_local

    if kind == "tk" and "hfsample" not in rest:
        cfg = EvalConfig(max_new_tokens=a.new, do_sample=True, temperature=1.0, top_p=1.0, generate_cache=cache,
                         generate_batch_size=a.prompts)
        generate_local(model, prompts, cfg, mc=mc, zero3=False, pad_id=0, eos_id=None, seeds=list(range(len(prompts))))
    else:
        ids = torch.tensor(prompts, device=a.device)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                           min_new_tokens=a.new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0,
                           use_cache=True,  # a training config has it off (runtime/model.py)
                           **({"cache_implementation": "static"} if cache == "static" else {}))
    if a.device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    # Liger's RoPE patch replaces a module-level function for good: the Liger variants come last
    ap.add_argument("--variants", default="hf-dyn,hf-static,tk-dyn,tk-static,tk-hfsample,tk-liger-dyn,"
                                          "tk-liger-static,tk-liger-hfsample")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randint(10, a.vocab - 1) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    rows: list[dict[str, Any]] = []
    for variant in a.variants.split(","):
        kind, *rest = variant.split("-")
        liger = "liger" in rest
        cache = "static" if "static" in rest else "dynamic"
        torch.manual_seed(0)
        model, mc = build(a.model, a.vocab, liger, kind == "tk", a.device)
        what = (a, kind, rest, cache, model, mc, prompts)
        row: dict[str, Any] = {"variant": variant, "liger": liger, "cache": cache}
        try:
            t0 = time.perf_counter()
            _generate(*what)
            row["first_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            _generate(*what)
            seconds = time.perf_counter() - t0
            row |= {"seconds": round(seconds, 3), "ms_per_step": round(1000 * seconds / a.new, 2),
                    "tokens_per_s": round(a.prompts * a.new / seconds)}
        except Exception as e:  # a variant that fails is a row with its error, the others still run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, what
        if a.device == "cuda":
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
