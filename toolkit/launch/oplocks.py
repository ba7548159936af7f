"""DeepSpeed's JIT op builds and their locks: a stale lock named and cleared before anything waits on it.

DeepSpeed builds its ops (the CPU shared-memory all-reduce, CPU Adam, FusedAdam, async I/O) through
`torch.utils.cpp_extension.load`, which guards each build folder with a `lock` file (torch's FileBaton: created
with O_EXCL, removed when the build ends). A build killed mid-way (a deadline, the OOM killer, Ctrl-C at the wrong
moment) leaves the file, and every later load of that op on the machine waits for it forever in
`FileBaton.wait`, silently, both ranks idle (issue 81, seen after a test killed a FusedAdam build). torch has no
timeout and the file holds no owner.

So before the process group (whose shared-memory op is the first build) every rank looks at the lock files of its
extensions folder. A lock is stale when no process on this host is building in that folder (a build runs ninja and
the compiler there) and nothing in the folder changed for STALE_S: it is removed, with one line that says so. A
lock with a build behind it is waited for, with one line naming it and how long it has been going. A folder on a
shared filesystem may be built from another host, which this host cannot see; STALE_S is long enough for any
build that writes its objects as it goes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STALE_S = 300.0  # no file of the build folder changed for this long, and no builder here: nobody is building


@dataclass(frozen=True)
class Lock:
    path: Path
    age_s: float  # since the lock was made
    quiet_s: float  # since anything in its build folder last changed
    builders: tuple[int, ...]  # pids on this host working in the build folder

    @property
    def stale(self) -> bool:
        return not self.builders and self.quiet_s >= STALE_S


def extensions_root() -> Path:
    """The folder torch builds extensions in: TORCH_EXTENSIONS_DIR, or torch's per-Python default under the cache."""
    from torch.utils import cpp_extension

    # _get_build_directory(name) is ROOT/name (and makes it): the root is its parent, without making a probe folder
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import sys

    import torch

    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
             f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{py}_{accel}"


def _builders(folder: Path) -> tuple[int, ...]:
    """Processes on this host whose working directory is the build folder (ninja and the compilers it runs)."""
    found = []
    target = str(folder.resolve())
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if os.readlink(proc / "cwd") == target:
                found.append(int(proc.name))
    return tuple(found)


def find(root: Path | None = None, now: float | None = None) -> list[Lock]:
    """The build locks under the extensions root, each with its age, its folder's quiet time and its builders."""
    root = extensions_root() if root is None else root
    now = time.time() if now is None else now
    locks = []
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else []:
        try:
            made = lock.stat().st_mtime
            changed = max([made, *(f.stat().st_mtime for f in lock.parent.iterdir() if f.name != "lock")])
        except OSError:  # the build ended while we looked
            continue
        locks.append(Lock(lock, now - made, now - changed, _builders(lock.parent)))
    return locks


def _removed(lock: Lock) -> str:
    op = lock.path.parent.name
    with contextlib.suppress(FileNotFoundError):  # another rank of this host removed it first
        lock.path.unlink()
    return (f"removed a stale DeepSpeed op-build lock {lock.path} (made {lock.age_s / 60:.0f} min ago; no process on "
            f"this host builds {op} and nothing in its folder changed for {lock.quiet_s / 60:.0f} min): a build killed "
            f"mid-way leaves it, and every later load of {op} would wait on it forever; {op} is built again")


def clear_stale(root: Path | None = None, say: Callable[[str], None] = print, poll_s: float = 5.0) -> list[str]:
    """Remove every stale lock, and say so. A lock with a build behind it on this host is left to torch, which waits
    for the build, with a line naming it. A lock with no builder here that is not stale yet (a build on another
    host of a shared folder, or one killed minutes ago) is watched until it goes, a builder shows, or it turns
    stale and is removed. Returns the lines said."""
    said: list[str] = []

    def tell(line: str) -> None:
        said.append(line)
        say(line)

    watching: dict[Path, float] = {}
    building: set[Path] = set()
    while True:
        pending = []
        for lock in find(root):
            op = lock.path.parent.name
            if lock.stale:
                tell(_removed(lock))
            elif lock.builders:
                if lock.path in building:
                    continue
                building.add(lock.path)
                tell(f"DeepSpeed's build of {op} is going on (pid {', '.join(map(str, lock.builders))} on this "
                     f"host, {lock.age_s:.0f} s so far; lock {lock.path}): this run waits for it")
            else:
                if lock.path not in watching:
                    watching[lock.path] = time.monotonic()
                    tell(f"DeepSpeed's op-build lock {lock.path} has no builder on this host ({lock.age_s:.0f} s old, "
                         f"its folder changed {lock.quiet_s:.0f} s ago): waiting for it to go, or to be "
                         f"{STALE_S / 60:.0f} min quiet and stale")
                pending.append(lock)
        if not pending:
            return said
        time.sleep(poll_s)
