"""The multi-node pre-flight's judgement (toolkit/launch/preflight.py) on made-up host reports, the probe run
on this machine, and the launch.sh / .deepspeed_env / OpenMPI pieces around it. The same checks
against real hosts over ssh: tests/dist/test_multinode_ssh.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from toolkit.launch.dist import ranks_from_openmpi
from toolkit.launch.hostfile import deepspeed_env_vars
from toolkit.launch.preflight import common_interface, needed_slots, probe, problems, selected_interfaces

REPO = Path(__file__).resolve().parents[2]
IFACES = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"], "ib0": ["192.168.0.2"]}


def host(**over: Any) -> dict[str, Any]:
    base = {"ok": True, "python": "3.11.7", "executable": "/py/bin/python3", "toolkit": "0.1.0",
            "toolkit_digest": "abc", "toolkit_path": "/repo/toolkit", "torch": "2.13.0", "deepspeed": "0.19.8",
            "cwd_ok": True, "cpus": 8, "gpus": 4, "interfaces": IFACES,
            "route": {"src": "10.0.0.2", "iface": "eth0"}}  # fmt: skip
    return base | over


LOCAL = host(cwd="/work")


def judge(reports: dict[str, dict[str, Any]], slots: dict[str, int] | None = None, accel: str = "cuda",
          env: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    return problems(
        LOCAL, reports, slots or dict.fromkeys(reports, 4), accel, env or {}, "pdsh", "10.0.0.1", 29500
    )


def test_fit_hosts_have_no_problems() -> None:
    assert judge({"a": host(), "b": host()}) == []


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        ({"ok": False, "stage": "ssh", "detail": "Connection refused"}, "b: not reachable over ssh (Connection refused)"),
        ({"ok": False, "stage": "python", "detail": "/py/bin/python3 failed there: not found"}, "same Python at the same path"),
        (host(python="3.10.1"), "b runs Python 3.10.1 (/py/bin/python3), this node 3.11.7"),
        (host(toolkit_digest="def"), "b has toolkit 0.1.0 (source def)"),
        (host(toolkit=None, toolkit_error="ModuleNotFoundError"), "b: cannot import the toolkit"),
        (host(deepspeed="0.18.0"), "b has deepspeed 0.18.0, this node 0.19.8"),
        (host(cwd_ok=False), "b: the launch directory /work does not exist there"),
        (host(route={"error": "Network is unreachable"}), "b: no route to the master 10.0.0.1"),
        (host(master_reachable="timed out"), "b: cannot reach the master 10.0.0.1"),
        (host(port_free="Address already in use"), "master port 29500 is in use"),
        (host(gpus=2), "b: the launch puts 4 rank(s) there but it has 2 GPU(s)"),
    ],
)  # fmt: skip
def test_one_line_per_problem(report: dict[str, Any], expected: str) -> None:
    found = judge({"a": host(), "b": report})
    assert len(found) == 1 and expected in found[0], found


def test_another_python_is_one_line_not_a_cascade() -> None:
    found = judge({"a": host(), "b": host(python="3.10.1", torch=None, deepspeed=None)})
    assert len(found) == 1 and "Python 3.10.1" in found[0], found


def test_slots_count_cpus_on_cpu_runs() -> None:
    assert judge({"a": host(cpus=2)}, {"a": 2}, accel="cpu") == []
    (line,) = judge({"a": host(cpus=2)}, {"a": 3}, accel="cpu")
    assert "3 rank(s) there but it has 2 CPU core(s)" in line


def test_interface_variables() -> None:
    names = sorted(IFACES)
    assert selected_interfaces("GLOO_SOCKET_IFNAME", "eth0", names) == ["eth0"]
    assert selected_interfaces("GLOO_SOCKET_IFNAME", "eth", names) == []  # gloo: exact names only
    assert selected_interfaces("NCCL_SOCKET_IFNAME", "eth", names) == ["eth0"]  # NCCL: prefixes
    assert selected_interfaces("NCCL_SOCKET_IFNAME", "=eth", names) == []
    assert selected_interfaces("NCCL_SOCKET_IFNAME", "^lo,ib", names) == ["eth0"]
    # the same mistake on every host: one line naming them all
    (line,) = judge({"a": host(), "b": host()}, env={"GLOO_SOCKET_IFNAME": "ens5"})
    assert line.startswith(
        "GLOO_SOCKET_IFNAME=ens5 matches no interface on a, b (interfaces there: eth0, ib0, lo)"
    )
    assert "reached through eth0" in line
    (line,) = judge({"a": host(), "b": host()}, env={"NCCL_SOCKET_IFNAME": "lo"})
    assert "selects only loopback" in line
    # NCCL_SOCKET_IFNAME does not matter to a CPU (gloo) run
    assert judge({"a": host(cpus=8)}, {"a": 1}, accel="cpu", env={"NCCL_SOCKET_IFNAME": "ens5"}) == []


def test_common_interface_and_slots() -> None:
    assert common_interface({"a": host(), "b": host()}) == "eth0"
    assert common_interface({"a": host(), "b": host(route={"src": "1.1.1.1", "iface": "ens5"})}) is None
    assert common_interface({"a": host(), "b": {"ok": False}}) == "eth0"  # a host down is its own problem
    assert needed_slots({"a": 8, "b": 8}, None, None) == {"a": 8, "b": 8}
    assert needed_slots({"a": 8, "b": 8}, None, 2) == {"a": 2, "b": 2}
    assert needed_slots({"a": 8, "b": 8}, "a:0,5@b", None) == {"a": 6, "b": 8}


def test_probe_runs_here(tmp_path: Path) -> None:
    r = probe(None, {"repo": str(REPO), "cwd": str(tmp_path), "master": "127.0.0.1"}, sys.executable, 10)
    assert r["ok"] and r["python"] == platform.python_version() and r["cwd_ok"], r
    assert r["toolkit_path"] == str(REPO / "toolkit") and len(r["toolkit_digest"]) == 12
    assert r["route"]["src"] == "127.0.0.1" and r["cpus"] >= 1
    bad = probe(None, {"repo": str(REPO), "cwd": "/nonexistent"}, "/nonexistent/python", 10)
    assert not bad["ok"] and bad["stage"] == "python"


def test_deepspeed_env_for_openmpi_skips_values_deepspeed_would_quote() -> None:
    env = {"HF_HOME": "/data/hf home", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}
    assert deepspeed_env_vars(env, "pdsh") == (env, [])  # quoted for the remote shell: arrives intact
    # `mpirun -x HF_HOME="/data/hf home"` has no shell to remove the quotes: the rank would see them
    chosen, skipped = deepspeed_env_vars(env, "openmpi")
    assert skipped == ["HF_HOME"] and chosen == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}


def test_ranks_from_openmpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert not ranks_from_openmpi(dict(env))  # no MASTER_ADDR: leave it to DeepSpeed's mpi4py discovery
    env["MASTER_ADDR"] = "10.0.0.1"
    assert ranks_from_openmpi(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("3", "4", "1", "29500")
    assert not ranks_from_openmpi(env | {"RANK": "0"})  # the DeepSpeed launcher's own variables win


def _launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable}
    return subprocess.run([str(REPO / "launch.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_launch_sh_multi_node_dry_run(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("w1 slots=2\nw2 slots=2\n")
    r = _launch("--stage", "3", "--hostfile", str(hf), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (
        f"would check hosts: {sys.executable} -m toolkit.launch.preflight --hostfile {hf} --launcher pdsh"
        in r.stdout
    )
    # the runner under $PYTHON: the interpreter DeepSpeed starts on every host is the one checked
    assert f"command: {sys.executable} -m deepspeed.launcher.runner --hostfile" in r.stdout
    r = _launch(
        "--stage",
        "3",
        "--hostfile",
        str(hf),
        "--launcher",
        "openmpi",
        "--gpus",
        "1",
        "--dry-run",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "--launcher openmpi starts every slot" in r.stderr
    r = _launch("--stage", "3", "--hostfile", str(hf), "--master-addr", "$(id)", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and "--master-addr must be" in r.stderr
