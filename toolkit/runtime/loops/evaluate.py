"""The held-out loss (data.eval_source or data.eval_fraction), the same on both training paths.

Every rank runs the same number of forwards on its share of the held-out rows, because under ZeRO-3 each
forward gathers parameters from all ranks: a rank with fewer rows runs a masked copy of a row (labels all
-100, so it adds nothing). Token-loss sums and token counts stay on the device and are reduced once at the
end, so the loss is the token mean over the whole held-out set, whatever the world size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from toolkit.launch import dist
from toolkit.runtime.data.batches import rank_batches, to_device
from toolkit.runtime.data.corpus import IGNORE_INDEX


@torch.no_grad()
def evaluate(engine: Any, rows: Sequence[dict[str, Any]], collate: Any, micro: int, task: str,
             sp: Any = None) -> dict[str, float]:
    """Every rank calls it (a collective under ZeRO-3). Eval mode for the pass, the caller's mode after.
    sp (sequence/ulysses.py's SequenceParallel): each group shares the batches, each rank its slice of them,
    so eval runs at the training length on the same memory."""
    t0 = time.perf_counter()
    device = dist.device()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    was_training = engine.training
    engine.eval()
    try:
        rank, world = (sp.dp_rank, sp.dp_world) if sp else (dist.rank(), dist.world_size())
        for idx in rank_batches(len(rows), micro, rank, world):
            samples = [rows[i] for i in idx] if idx != [-1] else [_masked(rows[0], task)]
            b = to_device(sp.shard(collate(samples)) if sp else collate(samples), device)
            if task == "seq_cls":
                labels = b.pop("labels")
                logits = engine(**b).logits.float()
                real = 0 if idx == [-1] else len(idx)
                loss_sum += torch.nn.functional.cross_entropy(logits[:real], labels[:real], reduction="sum")
                count += real
            else:
                # num_items_in_batch=1: the model's (or Liger's fused) loss is then the sum over the batch's
                # target tokens, without materializing the logits here
                loss_sum += engine(**b, num_items_in_batch=torch.ones((), device=device)).loss.double()
                count += target_count(b)
    finally:
        engine.train(was_training)
    total = dist.all_reduce_tensor(torch.stack([loss_sum, count]))
    loss = float(total[0] / total[1]) if float(total[1]) > 0 else float("nan")
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 80.0)), "eval_tokens": int(total[1]),
            "eval_s": time.perf_counter() - t0}


def target_count(batch: dict[str, Any]) -> torch.Tensor:
    """Target tokens of a causal-LM batch (labels shift by one; a sequence-parallel slice has them shifted)."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def _masked(row: dict[str, Any], task: str) -> dict[str, Any]:
    if task == "seq_cls":
        return dict(row)
    return {**row, "labels": [IGNORE_INDEX] * len(row["labels"])}
