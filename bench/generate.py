"""Generation under ZeRO-3 (issue 48): today's path against the toolkit's, and the unsharded ceiling, in one launch.

    deepspeed --num_gpus 2 bench/generate.py --out OUT/generate.json

Every rank builds the same random-init model (model.name, bf16) as a ZeRO-3 inference engine (ds_configs/zero3.json
made fit for inference, as toolkit/generate.py does), then times, greedy, no stop token (every prompt runs to
--new tokens):
  before   the generate_all this change replaced (one prompt per generate call, synced_gpus, every layer gathered
           per token), on the first --before-prompts prompts: loaded from .baseline/generate_before.py, which is
           `git show 3571305:toolkit/runtime/generate.py` (the file as it was);
  gathered the toolkit's generate_all, defaults: the whole model gathered once, left-padded batches (auto size);
  layers   the same with eval.generate_gather=false: layer by layer, batched, synced_gpus;
  gathered_static  the same as gathered with eval.generate_cache=static (transformers compiles the decode step);
           each of these three timed twice: NAME_first_call (cold) and NAME (the same call again);
  ceiling  rank 0 alone: plain transformers generate of the unsharded bf16 model on its GPU, rank 0's share of the
           prompts in one left-padded batch (the batch the toolkit's auto size chose), dynamic cache; and
           ceiling_static: the same with cache_implementation="static" (transformers compiles the decode step).
           Both with torch.nn.functional.linear as torch ships it (zero.Init replaced it process-wide; the toolkit
           puts it back while it generates, gather.plain_linear), each timed after the same call untimed.
tokens/s counts new tokens over all ranks; per GPU divides by the world size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.launch import dist


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _before() -> Any:
    path = Path(__file__).resolve().parent.parent / ".baseline" / "generate_before.py"
    spec = importlib.util.spec_from_file_location("generate_before", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--before-prompts", type=int, default=16)
    ap.add_argument("--variants", default="before,gathered,layers,gathered_static,ceiling,ceiling_static")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    dist.prepare_env()
    dist.quiet_libraries()
    dist.init_distributed()
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from toolkit.config.ds_config import load_ds_config
    from toolkit.config.schema import EvalConfig, load_config
    from toolkit.runtime.generation.batched import generate_all
    from toolkit.runtime.generation.command import inference_ds_config
    from toolkit.runtime.generation.gather import plain_linear
    from toolkit.runtime.model import hidden_size, model_config

    world, rank = dist.world_size(), dist.rank()
    cfg = load_config(None, [f"model.name={args.model}"])
    mc = model_config(cfg)
    mc.eos_token_id = None  # no stop token: every prompt generates --new tokens
    ds = inference_ds_config(load_ds_config("ds_configs/zero3.json"), world, hidden_size(mc))
    ds["bf16"] = {"enabled": True}
    ds.pop("fp16", None)
    prompts = _prompts(args.prompts, args.min_len, args.max_len, mc.vocab_size, 0)
    torch.manual_seed(0)
    alive = [HfDeepSpeedConfig(ds)]  # zero.Init while the model is built (a weak reference in transformers)
    model = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    engine = deepspeed.initialize(model=model, config=ds)[0]
    rows: dict[str, Any] = {"model": args.model, "world": world, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                            "prompts": args.prompts, "prompt_lengths": [args.min_len, args.max_len],
                            "new_tokens": args.new, "torch": torch.__version__,
                            "transformers": __import__("transformers").__version__}

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # CPU: a dry run of the script (model.name=tiny)

    def timed(name: str, fn: Any, n_prompts: int) -> None:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        note = fn()
        sync()
        dist.barrier()
        s = time.perf_counter() - t0
        tokens = n_prompts * args.new
        rows[name] = {"prompts": n_prompts, "new_tokens": tokens, "seconds": round(s, 3),
                      "tokens_per_s": round(tokens / s, 1), "tokens_per_s_per_gpu": round(tokens / s / world, 1),
                      **(note or {})}
        if rank == 0:
            print(name, rows[name], flush=True)

    if "before" in variants:  # one prompt per call: warmed on a few prompts, not the whole (long) call again
        old = _before()
        ec = EvalConfig(max_new_tokens=args.new)
        old.generate_all(engine, prompts[:4], EvalConfig(max_new_tokens=4), zero3=True, pad_id=0, eos_id=None)
        few = prompts[: args.before_prompts]
        timed("before", lambda: old.generate_all(engine, few, ec, zero3=True, pad_id=0, eos_id=None) and None,
              len(few))
    for name, gather, cache in (("gathered", "auto", "dynamic"), ("layers", "false", "dynamic"),
                                ("gathered_static", "auto", "static")):
        if name not in variants:
            continue
        ec = EvalConfig(max_new_tokens=args.new, generate_gather=gather, generate_cache=cache)

        def run(ec: EvalConfig = ec) -> dict[str, Any]:
            out, st = generate_all(engine, prompts, ec, mc=mc, zero3=True, pad_id=0, eos_id=None)
            if rank == 0:
                assert all(len(o) == args.new for o in out), "a prompt stopped early"
            return {"path": st.path, "batch_size": st.batch_size, "reason": st.reason}

        timed(f"{name}_first_call", run, len(prompts))  # cold: allocator growth, a static cache's compile
        timed(name, run, len(prompts))  # the same call again
    batch = rows.get("gathered", {}).get("batch_size") or (len(prompts) + world - 1) // world
    engine = None  # the sharded engine and ZeRO-3's config gone before the plain model is built
    alive.clear()
    if cuda:
        torch.cuda.empty_cache()
    ceilings = [v for v in variants if v.startswith("ceiling")]
    if ceilings and rank == 0:
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16).to(dist.device()).eval()
        plain.generation_config.eos_token_id = None
        share = [p for i, p in enumerate(prompts) if i % world == 0][:batch]
        width = max(map(len, share))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in share]).to(dist.device())
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in share]).to(dist.device())
        for name in ceilings:
            extra = {"cache_implementation": "static"} if name == "ceiling_static" else {}
            with torch.no_grad(), plain_linear():
                plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                               pad_token_id=0, use_cache=True, **extra)  # warm-up: the same call (a static cache compiles here)
                sync()
                t0 = time.perf_counter()
                res = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                     pad_token_id=0, use_cache=True, **extra)  # training configs have it off
                sync()
            s = time.perf_counter() - t0
            tokens = len(share) * (res.shape[1] - width)
            rows[name] = {"prompts": len(share), "new_tokens": tokens, "seconds": round(s, 3),
                          "tokens_per_s": round(tokens / s, 1), "batch_size": len(share), "gpus": 1}
            print(name, rows[name], flush=True)
    dist.barrier()
    if rank == 0:
        r = rows
        if "gathered_static" in r and "gathered" in r:
            r["static_vs_dynamic"] = round(r["gathered_static"]["tokens_per_s"] / r["gathered"]["tokens_per_s"], 3)
            r["static_vs_dynamic_first_call"] = round(r["gathered_static_first_call"]["tokens_per_s"]
                                                      / r["gathered_first_call"]["tokens_per_s"], 3)
        if "before" in r:
            for k in ("gathered", "layers"):
                if k in r:
                    r[f"{k}_vs_before"] = round(r[k]["tokens_per_s"] / r["before"]["tokens_per_s"], 2)
        for mine, c in (("gathered", "ceiling"), ("gathered", "ceiling_static"), ("gathered_static", "ceiling_static")):
            if mine in r and c in r:
                r[f"{mine}_per_gpu_vs_{c}"] = round(r[mine]["tokens_per_s_per_gpu"] / r[c]["tokens_per_s"], 3)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
        print(json.dumps(r, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    dist.exit_process(main())
