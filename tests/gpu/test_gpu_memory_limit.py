"""GPU tier (one GPU): memory.gpu_limit_gib caps the allocator (a smaller card tried on a bigger one)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu(1)


def test_an_allocation_past_the_limit_fails_and_the_rules_see_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit.launch import dist

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).total_memory
    limit_gib = 4.0
    monkeypatch.setattr(dist, "_gpu_limit_bytes", None)
    try:
        dist.limit_gpu_memory(limit_gib)
        from toolkit.plan.planner import CUDA_CONTEXT_GIB

        # the planner's card: the cap plus its CUDA-context allowance (the context lives outside the cap)
        ctx = int(CUDA_CONTEXT_GIB * 2**30)
        assert dist.gpu_memory_bytes() == int(limit_gib * 2**30) and dist.gpu_memory_bytes(ctx) == dist.gpu_memory_bytes() + ctx < total
        fits = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")  # 5 GiB together: past the cap
        del fits
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
