"""The raw loop's batch dealing, with and without loader workers (GPU runs use workers)."""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime.data.batches import EpochOrder, ListDataset, ShardedBatches


def _ids(batch: list[dict[str, int]]) -> list[int]:
    return [b["i"] for b in batch]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_skip_holds_with_loader_workers(workers: int) -> None:
    data = ListDataset([{"i": i} for i in range(32)])
    order = EpochOrder(len(data), seed=3, shuffle=True)
    expected = [order.order(0)[i:i + 2].tolist() for i in range(0, 32, 2)][1::2]  # rank 1 of 2, micro 2
    sampler = ShardedBatches(order, micro_batch=2, rank=1, world=2)
    sampler.skip = 5
    kw = {"num_workers": workers, "persistent_workers": True} if workers else {}
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=_ids, **kw)
    assert list(loader) == expected[5:]
    assert list(loader) == expected  # the next epoch starts from the beginning (same epoch number here)
