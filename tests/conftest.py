"""Test tiers: unit (pure, seconds), dist (real DeepSpeed on 2 CPU ranks), gpu(n) (skipped without n GPUs)."""

from __future__ import annotations

import os

import pytest

# Tests that launch DeepSpeed in this process tree run on the CPU accelerator unless GPUs exist.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        if have is None:
            have = _gpu_count()
        need = marker.args[0] if marker.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {have}"))


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_shm_buffers() -> object:
    """DeepSpeed's CPU shm comm op leaves a 66 MiB /dev/shm buffer per rank and port behind, and killed
    ranks (the fault tests) leave theirs too: across runs they fill /dev/shm, and then RAM. Remove the
    ones this session created, once every launched process is gone, and none that a live process still
    maps (another test session running beside this one: its ranks open their peers' buffers by name)."""
    from pathlib import Path

    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*")) if shm.is_dir() else set()
    yield
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.split()[-1] for line in maps.read_text().splitlines() if "deepspeed_allreduce" in line}
        except OSError:  # the process ended while we looked
            continue
    for f in set(shm.glob("deepspeed_allreduce_buffer_*")) - before if shm.is_dir() else ():
        if str(f) not in mapped:
            f.unlink(missing_ok=True)
