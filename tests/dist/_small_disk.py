"""A small filesystem for fault tests: a size-limited tmpfs in a mount namespace of its own.

One holder process (`unshare --mount ... sleep infinity`) owns the namespace and mounts the tmpfs at
`path`; commands run inside it through `nsenter --mount`, so the launcher and its ranks see the small
disk at `path` while the rest of the machine sees an empty directory there. The test reads and fills the
disk through `/proc/<holder>/root`, which shows the holder's mounts. Killing the holder (it dies with the
test process too, PR_SET_PDEATHSIG) ends the namespace and frees the tmpfs. Needs root (CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def problem() -> str | None:
    """Why this machine cannot make the disk (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN) for a mount namespace and a tmpfs"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("fallocate") is None:
        return "unshare, nsenter or fallocate is missing (util-linux)"
    return None


class SmallDisk:
    """`with SmallDisk(dir, size_bytes) as disk:` a tmpfs of that size at `dir`, seen by `disk.argv(...)`."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = Path(path).absolute()
        self.size_bytes = size_bytes
        self.holder: subprocess.Popen | None = None

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        script = f"mount -t tmpfs -o size={self.size_bytes} tmpfs '{self.path}' && exec sleep infinity"
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                       preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while f" {self.path} " not in self._mountinfo():
            if self.holder.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"could not mount a tmpfs at {self.path} in a mount namespace")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mountinfo(self) -> str:
        assert self.holder is not None
        try:
            return Path(f"/proc/{self.holder.pid}/mountinfo").read_text()
        except OSError:
            return ""

    def argv(self, argv: Sequence[str], cwd: Path) -> list[str]:
        """`argv` run in the disk's mount namespace, from `cwd` (nsenter would start it in /)."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "--mount", f"--wd={cwd}", "--", *argv]

    def view(self, path: Path | str = "") -> Path:
        """`path` (absolute, under the disk, or relative to it) as this process can open it."""
        assert self.holder is not None
        p = Path(path)
        p = p if p.is_absolute() else self.path / p
        return Path(f"/proc/{self.holder.pid}/root{p}")

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.view()).free

    def fill(self, leave_bytes: int, name: str = "filler") -> Path:
        """Take all free space but `leave_bytes` with one file (fallocate: instant, really allocated). Other
        writers may be filling the disk meanwhile, so it grows in chunks until the disk says no, then gives
        back what `leave_bytes` asks for."""
        filler = self.view(name)
        with filler.open("ab") as f:
            size, chunk = f.tell(), 64 << 20
            target = size + self.free_bytes() - leave_bytes
            while chunk >= 4096 and size < target:
                step = min(chunk, target - size)
                try:
                    os.posix_fallocate(f.fileno(), size, step)
                    size += step
                except OSError:  # ENOSPC: someone else took some of it
                    chunk //= 2
            short = leave_bytes - self.free_bytes()
            if short > 0:
                os.truncate(f.fileno(), max(0, size - short))
        return filler

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(timeout=10)
