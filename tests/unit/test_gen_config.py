"""`toolkit gen-config`: the committed presets are exactly what the command writes today, refusals are
one line, and `--help` stays instant (no torch/deepspeed import)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.config import ds_config as dc

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_committed_presets_equal_gen_config_all(tmp_path: Path) -> None:
    out = tmp_path / "presets"
    p = cli("gen-config", "--all", "-o", str(out))
    assert p.returncode == 0, p.stderr
    generated = sorted(f.name for f in out.iterdir())
    committed = sorted(f.name for f in (REPO / "ds_configs").glob("*.json"))
    assert generated == committed == sorted(f"{n}.json" for n in dc.PRESETS)
    for name in generated:
        assert (out / name).read_text() == (REPO / "ds_configs" / name).read_text(), name


def test_all_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    assert cli("gen-config", "--all", "-o", str(tmp_path)).returncode == 0
    p = cli("gen-config", "--all", "-o", str(tmp_path))
    assert p.returncode == 1
    assert p.stderr.strip().count("\n") == 0 and "--force" in p.stderr
    assert cli("gen-config", "--all", "-o", str(tmp_path), "--force").returncode == 0


def test_single_file_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "z2.json"
    assert cli("gen-config", "--stage", "2", "-o", str(target)).returncode == 0
    p = cli("gen-config", "--stage", "3", "-o", str(target))
    assert p.returncode == 1 and "--force" in p.stderr
    assert '"stage": 2' in target.read_text()


@pytest.mark.parametrize(
    "args",
    [
        ["--stage", "2", "--offload-param", "cpu"],  # parameter offload needs stage 3
        ["--stage", "0", "--offload-optimizer", "cpu"],
        [],  # neither --stage nor --all
    ],
)
def test_bad_combinations_are_one_line(args: list[str]) -> None:
    p = cli("gen-config", *args)
    assert p.returncode == 1
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1 and p.stderr.startswith("error: ")
    assert "Traceback" not in p.stderr


def test_usage_errors_exit_2() -> None:
    assert cli("gen-config", "--stage", "4").returncode == 2
    assert cli("gen-config", "--stage", "2", "--micro-batch", "0").returncode == 2


@pytest.mark.parametrize("args", [["--help"], ["gen-config", "--help"], ["check", "--help"]])
def test_help_is_fast_and_imports_nothing_heavy(args: list[str]) -> None:
    t = time.perf_counter()
    p = cli(*args)
    assert p.returncode == 0 and "usage: toolkit" in p.stdout
    assert time.perf_counter() - t < 10  # a torch import alone takes seconds; generous for busy machines
    code = (
        "import sys, toolkit.cli\n"
        f"try:\n    toolkit.cli.main({args!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert q.returncode == 0, q.stderr


def test_gen_config_to_stdout_is_valid_and_checks_clean() -> None:
    p = cli("gen-config", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu")
    assert p.returncode == 0
    import json

    assert json.loads(p.stdout) == dc.gen_config(3, "cpu", "cpu")
