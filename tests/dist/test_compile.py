"""train.compile=torch on both paths: the engine is really compiled and trains the same losses as eager."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.dist._net import free_port

ROOT = Path(__file__).resolve().parents[2]


def _train(run_dir: Path, path: str, compile_: str) -> tuple[list[float], str]:
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "toolkit/train.py",
           "--ds", "ds_configs/zero2.json", f"train.path={path}", f"train.compile={compile_}",
           "train.micro_batch_size=2", "train.max_steps=4", "train.export=false", "memory.every=0",
           "metrics.tensorboard=false", f"train.run_dir={run_dir}"]
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if x.strip()], log


@pytest.mark.dist
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("path", ["raw", "trainer"])
def test_compiled_engine_trains_the_eager_losses(tmp_path: Path, path: str) -> None:
    eager, log = _train(tmp_path / "eager", path, "off")
    assert "engine is compiled" not in log
    compiled, log = _train(tmp_path / "compiled", path, "torch")
    assert "torch.compile: the engine is compiled" in log  # from the engine's own is_compiled
    assert len(compiled) == len(eager) == 4
    # fp32 on CPU: inductor reorders some reductions, nothing more
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_compile_value_is_checked() -> None:
    from toolkit.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.compile must be off or torch"):
        load_config(None, ["train.compile=inductor"])
    assert load_config(None, ["train.compile=off"]).train.compile == "off"
    assert load_config(None, ["train.compile=true"]).train.compile == "torch"
