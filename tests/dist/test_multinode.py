"""Multi-node on one machine: two `launch.sh --no-ssh` invocations (node ranks 0 and 1) train as one job.

The hostfile names this machine twice (`localhost` and `127.0.0.1`, one slot each), so DeepSpeed's
launcher sees two nodes; with `--no_ssh` each invocation starts only the ranks of its own
`--node_rank` (one CPU rank each), and both meet at `--master_addr 127.0.0.1` as world size 2.
Both nodes share one run directory: rank 0 writes the shared files, each rank its memory file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _net import free_port

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch.sh"
STEPS = 3
MICRO_BATCH = 2
TIMEOUT_S = 540


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group the node's launcher leads (launcher, deepspeed.launch and its rank)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # stragglers that ignored SIGTERM
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.timeout(600)
def test_two_no_ssh_nodes_on_one_machine(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    # two names for this machine: two nodes of one slot each
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    run_dir = tmp_path / "run"
    port = free_port()
    env = _env()
    procs: dict[int, subprocess.Popen] = {}
    logs: dict[int, Path] = {}
    try:
        for node_rank in (0, 1):
            logs[node_rank] = tmp_path / f"node{node_rank}.log"
            argv = [
                str(LAUNCH), "--stage", "2", "--hostfile", str(hostfile), "--no-ssh",
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--", f"train.max_steps={STEPS}", f"train.run_dir={run_dir}",
                f"train.micro_batch_size={MICRO_BATCH}",
            ]  # fmt: skip
            with logs[node_rank].open("wb") as log:
                procs[node_rank] = subprocess.Popen(
                    argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        codes: dict[int, int | None] = {}
        for node_rank, proc in procs.items():
            try:
                codes[node_rank] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node_rank] = None
    finally:
        for proc in procs.values():
            _kill_group(proc)

    def tail(node_rank: int) -> str:
        return logs[node_rank].read_text(errors="replace")[-4000:]

    for node_rank, code in codes.items():
        assert code == 0, f"node {node_rank} exited {code}:\n{tail(node_rank)}"
    for node_rank in (0, 1):
        out = logs[node_rank].read_text(errors="replace")
        assert "world size: 2" in out, tail(node_rank)
        assert f"--node_rank {node_rank}" in out, tail(node_rank)
        # deepspeed.launcher.launch on each node: its own node rank, one global world of 2
        assert f"node_rank={node_rank}" in out and "dist_world_size=2" in out, tail(node_rank)

    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == STEPS, steps
    assert steps == list(range(1, STEPS + 1)), steps
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == MICRO_BATCH * 1 * 2  # micro batch x grad accum x world size 2
    for rank in (0, 1):
        assert (run_dir / "memory" / f"rank{rank}.jsonl").is_file(), rank
