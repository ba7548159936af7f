"""dist.settle_at_exit registers one exit handler, which sleeps only on a multi-rank run (the launch test
is tests/dist/test_exit_settle.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import atexit, os, sys, time
import torch.distributed  # loaded, as in any script that trained; the handler never imports it
from toolkit.launch import dist
calls = []
register = atexit.register
atexit.register = lambda f, *a, **k: calls.append(f)
dist.settle_at_exit(0.5)
dist.settle_at_exit(0.5)
atexit.register = register
assert len(calls) == 1, calls
t0 = time.monotonic()
calls[0]()
print(round(time.monotonic() - t0, 1))
"""


@pytest.mark.parametrize(("world", "slept"), [("1", "0.0"), ("2", "0.5")])
def test_registers_once_and_sleeps_only_on_a_multi_rank_run(world: str, slept: str) -> None:
    # WORLD_SIZE, not is_initialized(): Trainer.end() destroys the group while DeepSpeed keeps its threads
    env = os.environ | {"WORLD_SIZE": world}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == slept


def test_toolkit_callback_registers_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from toolkit import ToolkitCallback
    from toolkit.launch import dist

    seen: list[bool] = []
    monkeypatch.setattr(dist, "settle_at_exit", lambda: seen.append(True))
    ToolkitCallback(tmp_path / "run")
    assert seen == [True]
