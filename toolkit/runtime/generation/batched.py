"""Generation on every rank at once: the importable entry points.

`generate_local` generates this rank's own prompts (the online-RL step calls it on the live engine);
`generate_all` deals one list of prompts to the ranks and gathers the results on rank 0. Both are
collectives under ZeRO-3: every rank calls them, with any number of prompts (zero included).

Prompts go through `generate` in left-padded batches, longest first (little padding, and an
out-of-memory shows on the first batch). With the whole model gathered (`gather.py`) a forward runs no
collective, so each rank runs its own batches without synced_gpus; layer by layer under ZeRO-3 every
rank makes the same number of calls (short ranks run a throwaway one) with synced_gpus on.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from toolkit.config.schema import EvalConfig
from toolkit.launch import dist
from toolkit.plan.generation import STATIC_WIDTH
from toolkit.runtime.generation.gather import choose, plain_linear, whole_model
from toolkit.runtime.generation.guard import unguarded, unwrap, world
from toolkit.runtime.generation.sample import RowSampler, cut
from toolkit.runtime.generation.shard import deal, unshard


@dataclass
class GenStats:
    """One generation call over all ranks (rank 0's copy is the reduced one)."""

    prompts: int
    new_tokens: int
    seconds: float
    path: str
    reason: str
    batch_size: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    def line(self) -> str:
        return (f"generate: {self.prompts} prompts, {self.new_tokens:,} new tokens in {self.seconds:.1f} s "
                f"({self.tokens_per_s:,.0f} tokens/s), {self.path}, batch {self.batch_size} per rank: {self.reason}")

    def record(self) -> dict[str, Any]:
        return {"gen_prompts": self.prompts, "gen_new_tokens": self.new_tokens, "gen_s": self.seconds,
                "gen_tokens_per_s": self.tokens_per_s, "gen_path": self.path, "gen_batch_size": self.batch_size}


def stop_ids(model: Any, eos_id: int | None) -> set[int]:
    if eos_id is not None:
        return {eos_id}
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def generate_local(
    engine_or_model: Any,
    prompts: list[list[int]],
    cfg: EvalConfig,
    *,
    mc: Any,
    zero3: bool,
    pad_id: int,
    eos_id: int | None,
    seeds: list[int] | None = None,
) -> tuple[list[list[int]], GenStats]:
    """New tokens for each of this rank's prompts (cut after the first stop token), and the call's stats
    summed over ranks. Collective; `seeds` (one per prompt, default cfg.seed + i) seed the sampling.

    Greedy outputs equal a one-prompt-at-a-time `generate` (left padding with its mask and positions
    changes no token in fp32); sampled ones depend on the prompt's seed only.
    """
    import torch

    model = unwrap(engine_or_model)
    n_world = world()
    sharded = zero3 and n_world > 1
    static = cfg.generate_cache == "static"
    choice = choose(engine_or_model, mc, prompts, cfg.max_new_tokens, zero3=zero3, gather=cfg.generate_gather,
                    batch_size=cfg.generate_batch_size, width_multiple=STATIC_WIDTH if static else 1)
    # Lockstep (synced_gpus, equal calls) wherever a forward is a collective: ZeRO-3 layer by layer, and DeepSpeed's
    # AutoEP layers at any stage (an all-to-all in every forward).
    sync = n_world > 1 and ((sharded and not choice.gathered) or _expert_parallel(model))
    if seeds is None:
        seeds = [cfg.seed + i for i in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [order[k:k + choice.batch_size] for k in range(0, len(order), choice.batch_size)]
    calls = len(batches)
    if sync:  # layer by layer, every rank makes the same number of calls
        calls = int(_max(float(calls)))
    gen = unguarded(model)
    if sync and cfg.unsafe_no_sync:
        sync = False
        if dist.rank() == 0:
            print("warning: eval.unsafe_no_sync=true: synced_gpus is off under ZeRO-3; ranks that finish at "
                  "different steps will hang", file=sys.stderr, flush=True)
    # use_cache=True: a model in training has config.use_cache off (model.py), and generate takes its default from
    # the config: without it every new token recomputed the whole sequence
    # (a GRPO rollout of 256 tokens ran at 42 ms a token on an H200, 3.8 ms with the cache, bench/results/grpo/)
    kw: dict[str, Any] = dict(max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=pad_id,
                              synced_gpus=sync, temperature=None, top_p=None, top_k=None, use_cache=True)
    # A static cache compiles the decode step per shape (CUDA); few shapes: widths to a multiple of 64, full batches.
    static = static and not (zero3 and not choice.gathered)
    if static:
        kw["cache_implementation"] = "static"
    width_multiple, fill = (STATIC_WIDTH, choice.batch_size) if static else (1, 0)
    if eos_id is not None:
        kw["eos_token_id"] = eos_id
    stops = stop_ids(model, eos_id)
    device = dist.device()
    out: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    gathering = whole_model(engine_or_model) if choice.gathered else contextlib.nullcontext()
    try:
        with torch.no_grad(), gathering, plain_linear():
            for b in range(calls):
                rows = batches[b] if b < len(batches) else []
                batch = [prompts[i] for i in rows] or [[pad_id]]
                batch += [batch[0]] * (fill - len(batch))  # filler rows, dropped below
                ids, mask = _left_pad(batch, pad_id, device, width_multiple)
                extra: dict[str, Any] = {}
                if cfg.do_sample:
                    row_seeds = [seeds[i] for i in rows] or [0]
                    row_seeds += [row_seeds[0]] * (len(batch) - len(row_seeds))
                    extra["logits_processor"] = [RowSampler(row_seeds, cfg.temperature, cfg.top_p, device)]
                res = gen(input_ids=ids, attention_mask=mask, **kw, **extra)
                for r, i in enumerate(rows):
                    out[i] = cut(res[r, ids.shape[1]:].tolist(), stops)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    mine = [float(len(prompts)), float(sum(len(o) for o in out))]
    total_prompts, total_new, slowest = *dist.all_reduce_sum(mine), _max(seconds)
    stats = GenStats(int(total_prompts), int(total_new), slowest, choice.path, choice.reason, choice.batch_size)
    return out, stats


def _expert_parallel(model: Any) -> bool:
    """DeepSpeed's AutoEP replaced MoE layers in this model (their forward exchanges tokens between ranks)."""
    from toolkit.runtime.moe import autoep

    return "deepspeed" in sys.modules and autoep.replaced(model) > 0


def _max(value: float) -> float:
    """The largest of every rank's value (one all-reduce of a vector holding each rank's in its own slot)."""
    n = world()
    if n == 1:
        return value
    slots = [0.0] * n
    slots[dist.rank()] = value
    return max(dist.all_reduce_sum(slots))


def _left_pad(prompts: list[list[int]], pad_id: int, device: Any, multiple: int = 1) -> tuple[Any, Any]:
    import torch

    width = -(-max(len(p) for p in prompts) // multiple) * multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def generate_all(
    engine_or_model: Any,
    prompts: list[list[int]],
    cfg: EvalConfig,
    *,
    mc: Any,
    zero3: bool,
    pad_id: int,
    eos_id: int | None,
) -> tuple[list[list[int]] | None, GenStats]:
    """Generate for every prompt across all ranks; rank 0 gets the new tokens per prompt (others None).

    Every rank calls it with the same prompts. Prompt i is seeded with cfg.seed + i, so sampled outputs do
    not depend on the world size or the batch size.
    """
    import torch.distributed as tdist

    n_world = world()
    rank = tdist.get_rank() if n_world > 1 else 0
    mine = deal(prompts, rank, n_world)
    outs, stats = generate_local(engine_or_model, [p for _, p in mine], cfg, mc=mc, zero3=zero3, pad_id=pad_id,
                                 eos_id=eos_id, seeds=[cfg.seed + i for i, _ in mine])
    results = [(i, o) for (i, _), o in zip(mine, outs, strict=True)]
    if n_world == 1:
        return unshard([results], len(prompts)), stats
    gathered: list[Any] = [None] * n_world
    tdist.all_gather_object(gathered, results)
    return (unshard(gathered, len(prompts)) if rank == 0 else None), stats
