"""The console a person reads during a run: third-party noise goes to a per-rank log, not the screen.

Every warning raised while ``rank_log`` is active is appended, in full, to
``run_dir/logs/rank{N}.log``; only the ones a user can act on are also printed. A failure's
traceback is appended too, so the rank that broke says why even when its console output was lost
among the other ranks'. Records of the third-party loggers in NOISY_LOGGERS go there too, never to the screen.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

_TOOLKIT_DIR = Path(__file__).resolve().parents[1]

# Deprecations raised inside torch, DeepSpeed, transformers or accelerate (e.g. torch's
# "all_gather_into_tensor is deprecated", raised from DeepSpeed's ZeRO-2 reduce on every rank)
# name code the user does not own: they cannot act on them.
NOISE_CATEGORIES: tuple[type[Warning], ...] = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)

# Third-party warnings of other categories that state a default and need nothing from the user.
KNOWN_NOISE: tuple[re.Pattern[str], ...] = (
    # accelerate on CPU sets OMP/MKL threads to 2 per process itself and says so on every rank.
    re.compile(r"OMP_NUM_THREADS/MKL_NUM_THREADS unset"),
)


# Third-party loggers whose warnings need nothing from the user. Liger (0.8) logs a warning for every kernel backend
# it cannot import (cutedsl, ascend, cutile: other hardware or packages not installed) on every rank, before the
# lines that matter. `quiet_third_party()` keeps their records (in memory until a rank log exists, then in it);
# their errors reach the console as well.
NOISY_LOGGERS: tuple[str, ...] = ("liger_kernel",)


class _RankLogHandler(logging.Handler):
    """Records of NOISY_LOGGERS: held until `rank_log` names a file, then appended there, never printed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.path: Path | None = None
        self.held: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.levelno >= logging.ERROR:  # an error of theirs may be the reason a run fails: on the console too
            print(text, file=sys.stderr, flush=True)
        if self.path is None:
            self.held.append(text)
        else:
            _append(self.path, text)


_NOISE_HANDLER = _RankLogHandler()


def quiet_third_party() -> None:
    """Route NOISY_LOGGERS away from the console (idempotent); call before they are imported."""
    for name in NOISY_LOGGERS:
        log = logging.getLogger(name)
        if _NOISE_HANDLER not in log.handlers:
            log.addHandler(_NOISE_HANDLER)
        log.propagate = False


def is_third_party_noise(category: type[Warning], filename: str, message: Warning | str) -> bool:
    """True for a warning that goes to the per-rank log only. Warnings pointing into the toolkit
    always reach the console: those are ours to fix, or tell the user what to change."""
    with suppress(OSError, ValueError):
        if Path(filename).resolve().is_relative_to(_TOOLKIT_DIR):
            return False
    if issubclass(category, NOISE_CATEGORIES):
        return True
    return any(p.search(str(message)) for p in KNOWN_NOISE)


def whereabouts() -> str:
    """Host, interpreter and toolkit of this rank, then the launch variables it received (the
    `.deepspeed_env` allow-list): on a multi-node run, what to compare first when one node differs."""
    from toolkit import __version__
    from toolkit.launch.hostfile import allow_listed

    return (
        f"on {socket.gethostname()} (pid {os.getpid()}), Python {platform.python_version()} {sys.executable}, "
        f"toolkit {__version__}\nlaunch environment: {json.dumps(allow_listed(os.environ))}"
    )


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def _append(path: Path, text: str) -> None:
    # Open-append-close per entry: the text is on disk even if the process dies next.
    with suppress(OSError), path.open("a") as f:
        f.write(text if text.endswith("\n") else text + "\n")


@contextmanager
def rank_log(run_dir: Path, rank: int) -> Iterator[Path]:
    """Route warnings through the per-rank log for the duration of a run; restore on exit."""
    path = log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _append(path, f"--- rank {rank}, run started {time.strftime('%Y-%m-%d %H:%M:%S')} {whereabouts()}")
    previous = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        _append(path, warnings.formatwarning(message, category, filename, lineno, line))
        if not is_third_party_noise(category, filename, message):
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    _NOISE_HANDLER.path = path
    for text in _NOISE_HANDLER.held:
        _append(path, text)
    _NOISE_HANDLER.held.clear()
    try:
        yield path
    except BaseException:
        _append(path, traceback.format_exc())
        raise
    finally:
        warnings.showwarning = previous
        _NOISE_HANDLER.path = None
