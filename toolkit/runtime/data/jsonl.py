"""JSON-lines input with one-line errors. Torch-free, so light entry points can use it too."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
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


def check_rows(path: Path, label: str, check: Callable[[dict[str, Any], str], Any], what: str = "rows") -> None:
    """Before launch: the file exists and `check(row, "label: path:line")` passes for every row (a ConfigError
    naming the row otherwise); a file without rows is one too."""
    if not path.is_file():
        raise ConfigError(f"{label}: {path} is not a file")
    n = 0
    for lineno, row in read_objects(path, label):
        check(row, f"{label}: {path}:{lineno}")
        n += 1
    if n == 0:
        raise ConfigError(f"{label}: {path} has no {what}")


def is_messages(value: Any) -> bool:
    """A non-empty list of {"role": str, "content": str}: a conversation as chat templates take it."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
