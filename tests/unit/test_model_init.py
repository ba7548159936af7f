"""ZeRO-3 builds the same random weights as every other stage, tied embeddings included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tying", ["tied", "untied"])
def test_zero3_random_init_equals_the_plain_build(tmp_path: Path, tying: str) -> None:
    p = subprocess.run([sys.executable, str(HERE / "_zero3_init_check.py"), str(tmp_path / "store"), tying],
                       capture_output=True, text=True, timeout=280)
    line = [x for x in p.stdout.splitlines() if x.startswith("MAXDIFF")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    assert float(line[0].split()[1]) == 0.0, line


def test_training_forwards_build_no_kv_cache() -> None:
    """Every training config turns use_cache off (packed or not, checkpointing or not): a DynamicCache built in a
    training forward waits for the GPU at each layer (runtime/model.py); generation asks for its own."""
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import model_config

    for extra in ([], ["data.packing=true"], ["model.gradient_checkpointing=true"]):
        assert model_config(load_config(None, ["model.name=tiny", *extra])).use_cache is False, extra
