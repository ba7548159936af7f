"""JSON-lines input with one-line errors. Torch-free, so light entry points can use it too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError


def read_objects(path: Path, label: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; a bad line is a ConfigError naming it."""
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{label}: {path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{label}: {path}:{lineno}: each line must be a JSON object")
            yield lineno, row
