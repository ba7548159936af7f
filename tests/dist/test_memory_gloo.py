"""Two CPU processes over gloo: per-rank files and rank 0's cross-rank table at phase boundaries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _net import free_port

from toolkit.observe.memory import FIELDS, MemoryMonitor

WORLD = 2
PHASES = ["model_loaded", "engine_ready", "first_step", "step", "step", "final"]


def _worker(rank: int, run_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mon = MemoryMonitor(Path(run_dir), rank=rank, world_size=WORLD, local_rank=rank, every=2)
        tables = [
            mon.phase_boundary("model_loaded", 0),
            mon.phase_boundary("engine_ready", 0),
            mon.phase_boundary("first_step", 1),
        ]
        for step in range(2, 5):
            mon.maybe_step(step)  # no collective: ranks may call it at different times
        tables.append(mon.phase_boundary("final", 4))
        if rank == 0:
            assert all(t is not None for t in tables)
            Path(run_dir, "tables_rank0.txt").write_text("\n\n".join(tables))
        else:
            assert all(t is None for t in tables)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_memory_monitor_two_ranks_gloo(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path), free_port()), nprocs=WORLD, join=True)

    for rank in range(WORLD):
        rows = [
            json.loads(line) for line in (tmp_path / "memory" / f"rank{rank}.jsonl").read_text().splitlines()
        ]
        assert [r["phase"] for r in rows] == PHASES
        assert [r["step"] for r in rows] == [0, 0, 1, 2, 4, 4]
        for r in rows:
            assert tuple(r) == FIELDS
            assert r["rank"] == rank and r["local_rank"] == rank
            assert r["host_rss_gib"] > 0

    tables = (tmp_path / "tables_rank0.txt").read_text().split("\n\n")
    assert [t.splitlines()[0].split(" @ ")[1].split()[0] for t in tables] == [
        "model_loaded",
        "engine_ready",
        "first_step",
        "final",
    ]
    for table in tables:
        # CPU: one line per phase with every rank's host RSS, gathered from both processes
        assert len(table.splitlines()) == 1, table
        assert "host RSS rank 0 " in table and ", rank 1 " in table and "(CPU run: no GPU memory)" in table
