"""One run spec: a training run reads its DeepSpeed JSON once, with or without
`train.micro_batch_size=auto` (toolkit/runtime/spec.py: read_inputs, then build_spec).

Each case is a real one-rank CPU training through `toolkit.train.main`, in a child process that counts
every open of the JSON file (io.open and builtins.open: Path.read_text and hjson go through them). The
auto case finds its choice in the autotune cache, so no probe children run (they are separate processes
with their own read, and tests/dist/test_autotune.py covers them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[2]

DRIVER = r"""
import builtins, io, os, sys
from pathlib import Path
sys.path[0] = sys.argv[1]
ds = Path(sys.argv[2]).resolve()
reads = []
def counting(real):
    def open_(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == ds:
            reads.append(1)
        return real(file, *a, **k)
    return open_
builtins.open = counting(builtins.open)
io.open = counting(io.open)
from toolkit import train
from toolkit.launch import dist
rc = train.main(sys.argv[3:])
print(f"DS_JSON_READS={len(reads)} RC={rc}", flush=True)
dist.exit_process(rc)
"""


def _run(tmp: Path, ds: Path, *overrides: str) -> str:
    env = os.environ | {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
                        "TOOLKIT_CACHE": str(tmp / "cache")}
    args = ["--ds", str(ds), "train.path=raw", "train.max_steps=2", "train.export=false", "memory.every=0",
            "metrics.tensorboard=false", *overrides]
    p = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT), str(ds), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_run_reads_its_deepspeed_json_once(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text((ROOT / "ds_configs" / "zero2.json").read_text())
    out = _run(tmp_path, ds, f"train.run_dir={tmp_path / 'fixed'}", "train.micro_batch_size=2")
    assert "DS_JSON_READS=1 RC=0" in out, out[-3000:]

    # auto: the choice comes from the cache, keyed exactly as the run keys it
    sys.path.insert(0, str(ROOT))
    from toolkit.config.schema import load_config
    from toolkit.runtime.spec import read_inputs
    from toolkit.runtime.speed import autotune

    run = tmp_path / "auto"
    common = [f"train.run_dir={run}", "train.micro_batch_size=auto", "train.global_batch_size=4"]
    cfg = load_config(None, ["train.path=raw", "train.max_steps=2", "train.export=false", "memory.every=0",
                             "metrics.tensorboard=false", f"train.ds_config={ds}", *common])
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "1"
    try:
        key = autotune.key_of(read_inputs(cfg), "cpu")
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = old
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / autotune.RECORD).write_text(json.dumps([{"key": key, "micro_batch": 2, "grad_accum": 2}]))
    out = _run(tmp_path, ds, *common)
    assert "micro_batch_size=auto: 2 (recorded in" in out, out[-3000:]
    assert "DS_JSON_READS=1 RC=0" in out, out[-3000:]
    assert json.loads((run / "ds_config.json").read_text())["gradient_accumulation_steps"] == 2
