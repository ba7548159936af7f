"""What `deepspeed toolkit/generate.py --model DIR --prompts p.jsonl [--ds ds.json] [...]` runs.

ZeRO-3 stand-alone generation; the library lives in toolkit/runtime/generation/ (the same code the
training paths call for their eval generation). `python toolkit/generate.py ...` runs one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script by the deepspeed launcher: sys.path[0] is toolkit/ itself. Put the repo root there
    # instead, so `toolkit` is importable and nothing under toolkit/ shadows a library (as train.py does).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from toolkit.launch import dist
from toolkit.runtime.generation.command import main

if __name__ == "__main__":
    dist.exit_process(main())
