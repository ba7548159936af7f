"""Run one benchmark launch so that nothing of it outlives its time limit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

TIMED_OUT = 124


def call_group(cmd: list[str], cwd: Path, env: dict[str, str], log: IO[Any], timeout: float) -> int:
    """Run a launcher in a process group of its own; past `timeout`, or on Ctrl-C, the whole group is killed.

    subprocess's own timeout kills only the launcher, and SIGTERM is not enough either: the toolkit's
    ranks treat SIGTERM as preemption (finish the step, save) and DeepSpeed's launcher takes up to 30 s
    per rank to kill them, so the next configuration would measure beside them (or run out of memory).
    A benchmark keeps nothing of a run that is out of time, hence SIGKILL, and waiting until the group
    is gone."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return TIMED_OUT
    finally:  # also on KeyboardInterrupt: the group is not in the terminal's foreground any more
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the ranks are the group's other members
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
