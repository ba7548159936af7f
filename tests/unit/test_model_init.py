"""ZeRO-3 builds the same random weights as every other stage, tied embeddings included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tying", ["tied", "untied"])
def test_zero3_random_init_equals_the_plain_build(tmp_path: Path, tying: str) -> None:
    p = subprocess.run([sys.executable, str(HERE / "_zero3_init_check.py"), str(tmp_path / "store"), tying],
                       capture_output=True, text=True, timeout=280)
    line = [x for x in p.stdout.splitlines() if x.startswith("MAXDIFF")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    assert float(line[0].split()[1]) == 0.0, line
