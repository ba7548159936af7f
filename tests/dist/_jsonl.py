"""Read a run's .jsonl record (metrics, resumes, generations) in the distributed tests."""

from __future__ import annotations

import json
from pathlib import Path


def lines(path: Path) -> list[dict]:
    """One object per line. A torn or blank line raises: the toolkit writes whole lines only."""
    return [json.loads(x) for x in path.read_text().splitlines()]
