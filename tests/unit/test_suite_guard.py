"""The suite's time guard (tests/conftest.py): a run over its limit fails with one line naming the slowest tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest(limit_min: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"TOOLKIT_SUITE_LIMIT_MIN": limit_min}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/unit/test_layout.py::test_no_import_cycles"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_over_its_limit_fails_with_one_line_naming_the_slowest() -> None:
    over = _pytest("0.00001")
    lines = [x for x in over.stdout.splitlines() if x.startswith("error: the suite took")]
    assert over.returncode == 1 and len(lines) == 1, over.stdout[-3000:]
    assert "over its limit of 1e-05 min" in lines[0] and "test_no_import_cycles (" in lines[0], lines
    within = _pytest("60")
    assert within.returncode == 0 and "error: the suite took" not in within.stdout, within.stdout[-3000:]
