"""dist.exit_process: a launched rank leaves without interpreter finalization (where gloo's leftover
threads can abort a finished run), yet with its exit code, its atexit handlers run and stdio flushed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import atexit, sys
from toolkit.launch import dist
atexit.register(lambda: print("atexit ran", flush=False))
print("unflushed stdout", end="; ")
sys.stderr.write("unflushed stderr")
class Finalized:
    def __del__(self):
        print("finalized")  # interpreter finalization would print this; exit_process skips it
keep = Finalized()
dist.exit_process(3)
"""


def test_exit_code_atexit_and_flush_without_finalization() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "unflushed stdout; atexit ran\n"
    assert done.stderr == "unflushed stderr"
