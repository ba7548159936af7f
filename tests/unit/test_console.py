"""The per-rank log: third-party deprecations go there only; warnings a user can act on reach the console
too; a failure's traceback is kept."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import toolkit
from toolkit.observe.console import is_third_party_noise, log_path, rank_log

SITE = "/usr/lib/python3.11/site-packages"
OURS = str(Path(toolkit.__file__).parent / "runtime" / "loops" / "run.py")


def test_noise_rules() -> None:
    assert is_third_party_noise(FutureWarning, f"{SITE}/torch/distributed/c10d_logger.py", "deprecated")
    assert is_third_party_noise(DeprecationWarning, f"{SITE}/deepspeed/x.py", "deprecated")
    assert is_third_party_noise(
        UserWarning, f"{SITE}/accelerate/state.py", "OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 2"
    )
    assert not is_third_party_noise(UserWarning, f"{SITE}/transformers/x.py", "your labels are all -100")
    assert not is_third_party_noise(FutureWarning, OURS, "ours to fix")


def test_rank_log_routes_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
        before = warnings.showwarning
        with rank_log(tmp_path, 1) as path:
            warnings.warn_explicit(
                "all_gather_into_tensor is deprecated",
                FutureWarning,
                f"{SITE}/torch/distributed/c10d_logger.py",
                83,
            )
            warnings.warn_explicit("labels are all -100", UserWarning, f"{SITE}/transformers/trainer.py", 1)
        assert warnings.showwarning is before  # restored
    assert path == log_path(tmp_path, 1) == tmp_path / "logs" / "rank1.log"
    assert shown == ["labels are all -100"]
    text = path.read_text()
    assert "FutureWarning: all_gather_into_tensor is deprecated" in text
    assert "UserWarning: labels are all -100" in text


def test_rank_log_keeps_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="boom"), rank_log(tmp_path, 0):
        raise ValueError("boom")
    text = log_path(tmp_path, 0).read_text()
    assert "Traceback" in text and "ValueError: boom" in text


def test_liger_backend_warnings_reach_the_rank_log_not_the_console(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                    ) -> None:
    """Liger logs a warning per kernel backend it cannot import (cutedsl, ascend) on every rank: held until the rank
    log exists, then written there; nothing on the console."""
    import logging

    from toolkit.observe import console

    console.quiet_third_party()
    logging.getLogger("liger_kernel.backends.registry").warning("Backend impl '_cutedsl' could not be imported")
    with console.rank_log(tmp_path, 0):
        logging.getLogger("liger_kernel.backends.registry").warning("Backend impl '_ascend' could not be imported")
        logging.getLogger("liger_kernel.transformers").error("a kernel failed")  # errors reach the console too
    out = capsys.readouterr()
    assert "Backend impl" not in out.out + out.err and "a kernel failed" in out.err
    log = console.log_path(tmp_path, 0).read_text()
    assert "'_cutedsl' could not" in log and "'_ascend' could not" in log
