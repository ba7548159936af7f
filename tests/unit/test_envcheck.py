"""`toolkit env`: JSON report, NCCL interface warnings, unreachable hosts -> exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.launch.envcheck import check_cuda_arch, check_nccl

REPO = Path(__file__).resolve().parents[2]


def toolkit_env(
    *args: str, env: dict[str, str] | None = None, timeout: int = 180
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "env", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


def test_json_report_has_versions() -> None:
    r = toolkit_env("--no-build", "--json", env={"TORCH_CUDA_ARCH_LIST": "9.0a;8.0"})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # nothing but JSON on stdout (DeepSpeed's logs go to stderr)
    for name in ("python", "torch", "deepspeed", "transformers", "peft", "datasets"):
        assert name in report["versions"]
    assert report["versions"]["torch"] and report["versions"]["deepspeed"]
    assert "cuda" in report["versions"]
    assert isinstance(report["gpus"], list)
    assert report["ops"]["cpu_adam"]["skipped"] == "--no-build"
    assert report["cuda_arch"]["unparseable"] == ["9.0a"]
    assert "9.0;8.0" in report["cuda_arch"]["fix"]
    assert report["ok"] is True and report["errors"] == []


def test_text_report() -> None:
    r = toolkit_env("--no-build")
    assert r.returncode == 0, r.stderr
    assert "deepspeed" in r.stdout and "result: ok" in r.stdout


def test_unreachable_host_fails(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("nonexistent.invalid slots=1\n")
    r = toolkit_env("--no-build", "--json", "--hostfile", str(hf), "--ssh-timeout", "2")
    assert r.returncode == 1, r.stdout
    report = json.loads(r.stdout)
    assert report["ok"] is False
    if report["hosts"]["nonexistent.invalid"]["ok"] is None:
        pytest.skip("ssh is not installed here")
    assert report["hosts"]["nonexistent.invalid"]["ok"] is False
    assert any("nonexistent.invalid" in e for e in report["errors"])
    text = toolkit_env("--no-build", "--hostfile", str(hf), "--ssh-timeout", "2")
    assert text.returncode == 1 and "nonexistent.invalid" in text.stdout


def test_bad_hostfile_fails(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("worker-1 slots=zero\n")
    r = toolkit_env("--no-build", "--json", "--hostfile", str(hf))
    assert r.returncode == 1
    assert any(f"{hf}:1:" in e for e in json.loads(r.stdout)["errors"])


def test_nccl_socket_ifname_warnings() -> None:
    ifaces = ["eth0", "ib0", "lo"]
    _, w = check_nccl({"NCCL_SOCKET_IFNAME": "eth"}, ifaces)
    assert w == []
    _, w = check_nccl({"NCCL_SOCKET_IFNAME": "ens5,ib"}, ifaces)
    assert len(w) == 1 and "'ens5'" in w[0]
    _, w = check_nccl({"NCCL_SOCKET_IFNAME": "=eth"}, ifaces)  # exact match wanted
    assert len(w) == 1
    _, w = check_nccl({"NCCL_SOCKET_IFNAME": "^docker"}, ifaces)  # exclusion: nothing to check
    assert w == []
    nccl, _ = check_nccl({"NCCL_DEBUG": "INFO", "PATH": "/bin"}, ifaces)
    assert nccl == {"NCCL_DEBUG": "INFO"}


def test_cuda_arch_check() -> None:
    assert check_cuda_arch({})["unparseable"] == []
    assert check_cuda_arch({"TORCH_CUDA_ARCH_LIST": "9.0"})["fix"] is None
    got = check_cuda_arch({"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert got["unparseable"] == ["9.0a"] and got["fix"].startswith("export TORCH_CUDA_ARCH_LIST=9.0 ")
