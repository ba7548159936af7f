"""Notes the run plan prints before a launch (toolkit/runtime/spec.py)."""

from __future__ import annotations

import pytest

from toolkit.config import ds_config as dc
from toolkit.runtime.spec import _single_gpu_zero3


@pytest.mark.parametrize(("preset", "world", "cpu", "noted"), [
    ("zero3", 1, False, True),  # one GPU, ZeRO-3: shards nothing
    ("zero3", 2, False, False),
    ("zero3", 1, True, False),  # the Quickstart's CPU demo: speed is not the point there
    ("zero2", 1, False, False),
    ("zero3_offload", 1, False, False),  # parameter offload: ZeRO-3 is what moves them off the GPU
    ("zero3_offload_optimizer", 1, False, True),
])
def test_zero3_on_one_gpu_is_noted(monkeypatch: pytest.MonkeyPatch, preset: str, world: int, cpu: bool,
                                   noted: bool) -> None:
    if cpu:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    else:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    notes = _single_gpu_zero3(dc.preset(preset), world)
    assert bool(notes) == noted
    if noted:
        assert "shards nothing" in notes[0] and "ZeRO-2" in notes[0]
