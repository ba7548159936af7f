"""Checkpoint bookkeeping without DeepSpeed: completion markers, `latest`, pruning."""

from __future__ import annotations

from pathlib import Path

from toolkit.runtime.faults.checkpoint import (
    COMPLETE,
    atomic_write,
    complete_checkpoints,
    mark_complete,
    prune,
)


def _ckpt(root: Path, step: int, complete: bool) -> Path:
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    if complete:
        mark_complete(d, step)
    return d


def test_only_marked_checkpoints_count_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step, done in ((2, True), (4, True), (6, True), (8, False)):
        _ckpt(tmp_path, step, done)
    assert [s for s, _ in complete_checkpoints(tmp_path, "global_step")] == [2, 4, 6]
    removed = prune(tmp_path, "global_step", keep=2)
    assert sorted(d.name for d in removed) == ["global_step2", "global_step8"]  # oldest + the partial one
    assert sorted(d.name for d in tmp_path.iterdir()) == ["global_step4", "global_step6"]
    assert (tmp_path / "global_step6" / COMPLETE).is_file()


def test_unmarked_checkpoints_older_than_the_newest_complete_one_stay(tmp_path: Path) -> None:
    _ckpt(tmp_path, 2, False)  # e.g. written before completion markers existed
    _ckpt(tmp_path, 4, True)
    assert prune(tmp_path, "global_step", keep=0) == []
    assert (tmp_path / "global_step2").is_dir()


def test_keep_zero_keeps_every_complete_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _ckpt(tmp_path, step, True)
    assert prune(tmp_path, "global_step", keep=0) == []


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "latest"
    atomic_write(p, "global_step2")
    atomic_write(p, "global_step4")
    assert p.read_text() == "global_step4"
    assert [f.name for f in tmp_path.iterdir()] == ["latest"]


def _run(d: Path) -> Path:
    (d / "memory").mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    return d


def test_a_run_dir_holding_another_run_is_refused_with_the_fixes(tmp_path: Path) -> None:
    import pytest

    from toolkit.config.ds_config import ConfigError
    from toolkit.runtime.faults.checkpoint import claim_run_dir

    d = _run(tmp_path / "mine")
    with pytest.raises(ConfigError, match=r"train.resume=latest.*train.run_dir.*train.overwrite=true"):
        claim_run_dir(d, resume=False, overwrite=False, default=False)
    assert claim_run_dir(d, resume=True, overwrite=False, default=False) is None  # resume appends
    assert (d / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (d / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"notes\.txt"):  # overwrite removes only what a run wrote
        claim_run_dir(d, resume=False, overwrite=True, default=False)
    (d / "notes.txt").unlink()
    assert "removed" in (claim_run_dir(d, resume=False, overwrite=True, default=False) or "")
    assert d.is_dir() and not any(d.iterdir())
    assert claim_run_dir(tmp_path / "fresh", resume=False, overwrite=False, default=False) is None


def test_the_default_run_dir_moves_the_earlier_run_aside_intact(tmp_path: Path) -> None:
    from toolkit.runtime.faults.checkpoint import claim_run_dir

    d = _run(tmp_path / "default")
    for _ in range(2):  # twice in a row: two earlier runs kept side by side
        msg = claim_run_dir(d, resume=False, overwrite=False, default=True)
        assert msg and "moved to" in msg and not d.exists()
        _run(d)
    aside = sorted(p for p in tmp_path.iterdir() if p.name.startswith("default."))
    assert len(aside) == 2
    assert all((p / "metrics.jsonl").read_text() == '{"step": 1}\n' for p in aside)
