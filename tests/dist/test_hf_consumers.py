"""Configs that work where people use them (issue 24).

- Every shipped preset trains in a plain HF Trainer script (tests/dist/_plain_hf_trainer.py, nothing from
  the toolkit imported) on 2 CPU ranks through the real launcher; the presets as they were before
  (tests/fixtures/ds/presets_before_issue24/) go through the same launch, and the script refuses exactly
  those that `toolkit check --consumer hf-trainer` refuses.
- `toolkit check --consumer hf-trainer|accelerate` against HF's own code path (tests/dist/_hf_auto_probe.py:
  TrainingArguments + Trainer, or accelerate's Accelerator.prepare, in one process up to
  deepspeed.initialize) on the shipped presets, the old ones, gen-config's output for accelerate, and
  every peer config in ../shared/peer_configs (skipped where that directory is absent).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

from toolkit.config import ds_config as dc
from toolkit.config.checks import check_file

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OLD = REPO / "tests" / "fixtures" / "ds" / "presets_before_issue24"
PEERS = REPO.parent / "shared" / "peer_configs"
NVME = "zero3_offload_nvme"


def _copy(src: list[Path], dst: Path) -> list[Path]:
    """The configs as a user would run them here: NVMe offload pointed at a real directory (/local_nvme
    does not exist on this machine)."""
    dst.mkdir(parents=True)
    out = []
    for p in src:
        cfg = dc.load_ds_config(p)
        for block in ("offload_optimizer", "offload_param"):
            off = cfg.get("zero_optimization", {}).get(block)
            if isinstance(off, dict) and off.get("device") == "nvme":
                (dst / "nvme").mkdir(exist_ok=True)
                off["nvme_path"] = str(dst / "nvme")
        (dst / p.name).write_text(json.dumps(cfg, indent=2))
        out.append(dst / p.name)
    return out


def _auto_errors(path: Path, consumer: str) -> list[str]:
    """The keys `toolkit check` refuses for an "auto" this consumer does not fill."""
    return [f.key for f in check_file(path, world_size=2, consumer=consumer)
            if f.level == "error" and f.message.startswith('"auto" is not filled')]


def _async_io_available() -> bool:
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "b = get_accelerator().create_op_builder('AsyncIOBuilder')\n"
            "print('YES' if b is not None and b.is_compatible(verbose=False) else 'NO')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=os.environ | {"DS_ACCELERATOR": "cpu"})
    return p.stdout.strip().endswith("YES")


@pytest.mark.timeout(1800)  # the NVMe preset JIT-builds async_io on a fresh machine (cached afterwards)
def test_plain_hf_trainer_runs_presets_and_refuses_what_check_refuses(tmp_path: Path) -> None:
    if shutil.which("deepspeed") is None:
        pytest.skip("deepspeed launcher not on PATH")
    new = _copy(sorted((REPO / "ds_configs").glob("*.json")), tmp_path / "new")
    old = _copy(sorted(OLD.glob("*.json")), tmp_path / "old")
    assert [p.name for p in new] == [p.name for p in old] == sorted(f"{n}.json" for n in dc.PRESETS)
    nvme_ok = _async_io_available()
    # The old NVMe preset is refused before any I/O, so it runs everywhere; the new one needs async_io
    # (libaio), which .ci/run installs and tests/dist/test_presets_deepspeed.py insists on.
    runnable = [p for p in new if nvme_ok or p.stem != NVME]
    out = tmp_path / "results.json"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(HERE / "_plain_hf_trainer.py"),
           str(out), *map(str, runnable), *map(str, old)]
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, env=env, cwd=tmp_path)
    log = (p.stdout + p.stderr)[-8000:]
    assert out.is_file(), log
    results = json.loads(out.read_text())

    for cfg in runnable:
        r = results[str(cfg)]
        assert r["ok"], f"{cfg.name}: {r['error']}\n{log}"
        assert r["loss"] is not None and 0 < r["loss"] < 20
        assert _auto_errors(cfg, "hf-trainer") == []
    refused_by_hf: dict[str, str] = {}
    for cfg in old:
        r = results[str(cfg)]
        if not r["ok"]:
            m = re.search(r"`([\w.]+)` not found in kwargs", r["error"])
            assert m, f"{cfg.name} refused for another reason: {r['error']}"
            refused_by_hf[cfg.stem] = m.group(1)
    refused_by_check = {cfg.stem: _auto_errors(cfg, "hf-trainer") for cfg in old}
    assert set(refused_by_hf) == {k for k, v in refused_by_check.items() if v}
    for name, key in refused_by_hf.items():
        assert key in refused_by_check[name], (name, key, refused_by_check[name])
    # What the issue saw: the stage-2 presets on allgather_bucket_size, the stage-3 ones on max live parameters
    assert refused_by_hf["zero2"] == "zero_optimization.allgather_bucket_size"
    assert refused_by_hf["zero3"] == "zero_optimization.stage3_max_live_parameters"
    if not nvme_ok:
        pytest.fail(f"{NVME} not run through the plain HF Trainer: async_io cannot build here (install libaio-dev)")


@pytest.mark.timeout(600)
def test_check_agrees_with_the_hf_code_path(tmp_path: Path) -> None:
    configs = [*sorted((REPO / "ds_configs").glob("*.json")), *sorted(OLD.glob("*.json"))]
    for name, (stage, opt, par) in dc.PRESETS.items():  # what gen-config writes for accelerate users
        cfg = tmp_path / f"accelerate__{name}.json"
        dc.write_config(dc.gen_config(stage, opt, par, targets=["accelerate"]), cfg)
        configs.append(cfg)
    peers = sorted(PEERS.glob("*.json")) if PEERS.is_dir() else []
    configs += [p for p in peers if any(k for k, v in dc.iter_leaves(dc.load_ds_config(p)) if v == dc.AUTO)]
    out = tmp_path / "probe.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())}
    p = subprocess.run([sys.executable, str(HERE / "_hf_auto_probe.py"), str(out), *map(str, configs)],
                       capture_output=True, text=True, timeout=550, env=env, cwd=tmp_path)
    assert p.returncode == 0 and out.is_file(), (p.stdout + p.stderr)[-6000:]
    probe = json.loads(out.read_text())

    disagree = []
    for consumer in ("hf-trainer", "accelerate"):
        for path, r in probe[consumer].items():
            m = re.search(r"`([\w.]+)` not found in kwargs", r["error"] or "")
            # Any other failure before deepspeed.initialize would hide what HF does with "auto".
            assert r["reached"] or m, f"{consumer} {path}: {r['error']}"
            assert r["auto_left"] == [], f"{consumer} handed DeepSpeed an 'auto': {path} {r['auto_left']}"
            # AutoTP configs are probed without their tensor_parallel section, which fills no "auto"
            original = Path(path) if Path(path) in configs else next(
                c for c in configs if Path(path).name == f"no_tp__{c.name}")
            keys = _auto_errors(original, consumer)
            if bool(m) != bool(keys) or (m and m.group(1) not in keys):
                disagree.append((consumer, original.name, m.group(1) if m else None, keys))
    assert disagree == [], disagree
    # the corpus is what the issue names; absent in a bare checkout, so only then this part is skipped
    if not peers:
        pytest.skip(f"{PEERS} absent: the shipped and old presets agreed; peer configs not checked")
    refused = {Path(p).name for p, r in probe["hf-trainer"].items() if not r["reached"]}
    assert "deepspeedexamples__ds_offload_cpu.json" in refused  # stage3_max_live_parameters "auto"
