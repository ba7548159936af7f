"""A dead host ends the job on every host within 60 s: launch.sh over pdsh on two namespace hosts
(tests/dist/_hosts.py), ranks 0-1 on node0 (which launches, and whose rank 0 serves the rendezvous store)
and rank 2 on node1, default timeouts (collective_timeout_s 600, heartbeat_timeout_s 30).

- node1 dies: every process of it is killed at once (its PID 1), mid-step.
- node1 is cut off: its network interface goes down mid-step; nothing resets a connection, so only
  heartbeats (toolkit/runtime/faults/watchdog.py) and ssh's keepalive (launch.sh) can tell.
Either way node0's ranks exit non-zero, the launcher returns non-zero, status.json names rank 2 and
node1, and no process of the job is left on either host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hosts import Cluster, missing_tools, namespace_problem
from _jsonl import lines
from _load import load_seen
from _net import free_port

from toolkit.runtime.faults.watchdog import EXIT_LOST

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 60


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = namespace_problem()
    if why:
        pytest.skip(why)
    missing = missing_tools()
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install openssh-server pdsh (see .ci/run)")
    with Cluster(tmp_path / "hosts", ["node0", "node1"]) as c:  # one per test: the first one kills node1
        yield c
    assert c.leftovers() == [], "processes outlived the hosts"


def _env() -> dict[str, str]:
    drop = ("SLURM_", "CUDA_VISIBLE", "NCCL_", "GLOO_", "PDSH_", "OMPI_", "DS_ENV_FILE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return env | {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}


def _ours(c: Cluster, name: str) -> list[str]:
    """The job's processes on a host (launchers, pdsh, ssh, ranks); sshd's own session processes excepted."""
    return [p for p in c.processes(name) if "sshd" not in p.split(" ", 1)[1][:40]]


def _run_until_fault(c: Cluster, tmp: Path, fault: str) -> tuple[int, float, Path, str]:
    run_dir = tmp / "run"
    hostfile = c.hostfile(tmp / "hostfile", {"node0": 2, "node1": 1})
    args = [str(ROOT / "launch.sh"), "--stage", "2", "--hostfile", str(hostfile), "--master-port", str(free_port()),
            "--", "train.path=raw", "train.max_steps=5000", "train.export=false", "memory.every=0",
            "metrics.tensorboard=false", f"train.run_dir={run_dir}"]
    log = tmp / "launch.log"
    with log.open("wb") as out:
        proc = c.popen("node0", args, cwd=tmp, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "metrics.jsonl").exists() or len(lines(run_dir / "metrics.jsonl")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, (load_seen(), log.read_text(errors="replace")[-5000:])
            time.sleep(0.2)
        t0 = time.monotonic()
        if fault == "kill":
            os.kill(c.hosts["node1"].init_pid, signal.SIGKILL)  # the host's PID 1: every process of node1
        else:
            c.sh("node1", "ip link set tk0 down")
        rc = proc.wait(timeout=BOUND_S + 60)
        left = {}
        while time.monotonic() < t0 + BOUND_S + 30:
            left = {n: p for n in (["node0"] if fault == "kill" else ["node0", "node1"]) if (p := _ours(c, n))}
            if not left:
                break
            time.sleep(0.2)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            c.kill_all()
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert not left, f"left running {took:.0f} s after the fault ({load_seen()}): {left}\n{text[-3000:]}"
    return rc, took, run_dir, text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_dead_host_ends_the_job_on_every_host_within_60s(cluster: Cluster, tmp_path: Path, fault: str) -> None:
    rc, took, run_dir, out = _run_until_fault(cluster, tmp_path, fault)
    print(f"node1 {'killed' if fault == 'kill' else 'cut off'}: launcher exit {rc}, every process of the job "
          f"gone {took:.1f} s later")
    assert rc != 0 and took < BOUND_S, (rc, took, load_seen(), out[-3000:])
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["lost_ranks"] == [2] and status["lost_hosts"] == ["node1"], status
    assert status["detected_by"] == 0 and "no heartbeat for" in status["error"], status
    for rank in (0, 1):  # node0's ranks left through the watchdog: their stacks are in their logs
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "--- watchdog, rank" in log and "lost rank 2 on node1" in log and 'File "' in log, log[-2000:]
    assert f"exits with return code = {EXIT_LOST}" in out or f"exit code {EXIT_LOST}" in out, out[-3000:]
    if fault == "cut":  # node1's rank lost the store and ended itself the same way
        log = (run_dir / "logs" / "rank2.log").read_text()
        # node0 by name once a view arrived from rank 0, its address (MASTER_ADDR) when it was cut off before
        assert re.search(r"lost rank 0 on (node0|10\.77\.0\.1): the rendezvous store", log) and 'File "' in log, log[-2000:]
        cluster.sh("node1", "ip link set tk0 up")
