"""Why a gathered ZeRO-3 model decoded 3.3x slower than a plain one: DeepSpeed's process-wide F.linear patch.

    deepspeed --num_gpus 2 bench/generate_linear.py > OUT/linear.log

llama-1b (random init, bf16) as a ZeRO-3 inference engine; 128 prompts of 64-512 tokens in one left-padded batch;
32 new tokens, greedy, each timing after a 4-token warm-up of the same batch: the whole model gathered
(toolkit/runtime/generation/gather.py whole_model) with torch.nn.functional.linear as zero.Init left it (its
LinearFunctionForZeroStage3) and as torch ships it; then on rank 0 alone a plain model, both ways; a profile of each.
Written to find the cause; the toolkit's fix is gather.plain_linear.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.launch import dist


def main() -> int:
    dist.prepare_env()
    dist.quiet_libraries()
    dist.init_distributed()
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from toolkit.config.ds_config import load_ds_config
    from toolkit.config.schema import load_config
    from toolkit.runtime.generation.command import inference_ds_config
    from toolkit.runtime.generation.gather import whole_model
    from toolkit.runtime.model import hidden_size, model_config

    world, rank = dist.world_size(), dist.rank()
    mc = model_config(load_config(None, ["model.name=llama-1b"]))
    mc.eos_token_id = None
    ds = inference_ds_config(load_ds_config("ds_configs/zero3.json"), world, hidden_size(mc))
    ds["bf16"] = {"enabled": True}
    ds.pop("fp16", None)
    rng = random.Random(0)
    share = [[rng.randrange(10, mc.vocab_size) for _ in range(rng.randint(64, 512))] for _ in range(128)]
    width = max(map(len, share))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in share]).cuda()
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in share]).cuda()
    alive = [HfDeepSpeedConfig(ds)]
    model = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    engine = deepspeed.initialize(model=model, config=ds)[0]
    if rank == 0:
        print("F.linear:", F.linear, flush=True)

    def gen(m: Any, n: int) -> Any:
        with torch.no_grad():
            return m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                              synced_gpus=False, use_cache=True)  # a training config has it off (runtime/model.py)

    def timeit(label: str, m: Any, n: int = 32) -> None:
        gen(m, 4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(m, n)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        if rank == 0:
            print(f"{label}: {n} tokens x 128 in {s:.3f}s -> {128 * n / s:.0f} tok/s", flush=True)

    def prof(label: str, m: Any) -> None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            gen(m, 8)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"== {label} by self cpu", flush=True)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
            print(f"== {label} by cuda", flush=True)
            print(p.key_averages().table(sort_by="self_device_time_total", row_limit=12), flush=True)

    patched = F.linear
    engine.module.eval()
    with whole_model(engine) as m:
        timeit("gathered", m)
        prof("gathered", m)
        F.linear = ZeroInit.linear_bk
        timeit("gathered, F.linear restored", m)
        F.linear = patched
    dist.barrier()
    engine = None
    alive.clear()
    if rank == 0:
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16).cuda().eval()
        plain.generation_config.eos_token_id = None
        timeit("plain", plain)
        prof("plain", plain)
        F.linear = ZeroInit.linear_bk
        timeit("plain, F.linear restored", plain)
    dist.barrier()
    return 0


if __name__ == "__main__":
    dist.exit_process(main())
