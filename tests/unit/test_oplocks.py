"""DeepSpeed's op-build locks (toolkit/launch/oplocks.py): a stale one is removed and said, a live build is waited
for, a lock with no builder here is watched until it goes or turns stale."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from toolkit.launch import oplocks


def _lock(root: Path, op: str, age_s: float) -> Path:
    folder = root / op
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("rule cxx\n")
    lock = folder / "lock"
    lock.write_text("")
    then = time.time() - age_s
    for f in (folder / "build.ninja", lock):
        os.utime(f, (then, then))
    return lock


def test_a_lock_a_killed_build_left_is_removed_and_said(tmp_path: Path) -> None:
    """Issue 81: a FusedAdam build killed mid-way left py311_cpu/fused_adam/lock; every later run waited on it
    forever in FileBaton.wait, saying nothing."""
    lock = _lock(tmp_path, "fused_adam", age_s=3600)
    said: list[str] = []
    lines = oplocks.clear_stale(tmp_path, say=said.append)
    assert not lock.exists() and lines == said and len(said) == 1
    assert said[0].startswith(f"removed a stale DeepSpeed op-build lock {lock} (made 60 min ago") and "fused_adam" in said[0]


def test_a_build_going_on_here_is_left_to_finish(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "cpu_adam", age_s=3600)  # old, yet a compiler works in its folder
    builder = subprocess.Popen(["sleep", "30"], cwd=lock.parent)
    try:
        said: list[str] = []
        oplocks.clear_stale(tmp_path, say=said.append)
        assert lock.exists() and len(said) == 1
        assert f"DeepSpeed's build of cpu_adam is going on (pid {builder.pid} on this host" in said[0], said
    finally:
        builder.kill()
        builder.wait()


def test_a_young_lock_with_no_builder_is_watched_until_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build on another host of a shared folder, or one killed a minute ago: waited on, not removed at once."""
    lock = _lock(tmp_path, "deepspeed_shm_comm", age_s=1)
    threading.Timer(0.5, lock.unlink).start()  # the build elsewhere ends
    said: list[str] = []
    t0 = time.monotonic()
    oplocks.clear_stale(tmp_path, say=said.append, poll_s=0.1)
    assert 0.4 < time.monotonic() - t0 < 5 and len(said) == 1 and "has no builder on this host" in said[0], said
    # ... or it stays quiet until it is stale, and then it is removed
    lock = _lock(tmp_path, "async_io", age_s=0)
    monkeypatch.setattr(oplocks, "STALE_S", 0.5)
    said.clear()
    oplocks.clear_stale(tmp_path, say=said.append, poll_s=0.1)
    assert not lock.exists() and [s.split(" ", 1)[0] for s in said] == ["DeepSpeed's", "removed"], said


def test_nothing_to_say_without_locks(tmp_path: Path) -> None:
    assert oplocks.clear_stale(tmp_path / "absent", say=print) == []
    assert oplocks.clear_stale(tmp_path, say=print) == []


def test_the_root_is_where_torch_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert oplocks.extensions_root() == tmp_path / "ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # torch's default root, under this test's folder
    assert oplocks.extensions_root() == Path(cpp_extension._get_build_directory("probe", False)).parent
