"""Multi-node for real: `launch.sh --hostfile` over ssh to two hosts made of Linux namespaces.

tests/dist/_hosts.py makes the hosts (own network, hostname, /etc/hosts, ssh client config and PID
namespace each; a real OpenSSH server on each; a bridge between them). Every launch here runs on
node0 as a person would run it on a cluster's first node, through the real pdsh or mpirun and the
real DeepSpeed launcher; ranks 0-1 run on node0 and ranks 2-3 on node1, talking gloo over the
bridge. node2 has an address but no sshd: a host that is down.

What this cannot show: real NICs, InfiniBand, NCCL, GPUs, separate filesystems (the hosts share
this machine's files, so a different Python or checkout on one host is simulated by a bind mount
on that host only), or a slow network.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from _hosts import IFACE, Cluster, missing_tools, namespace_problem
from _net import free_port

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch.sh"
STEPS = 3
TRAIN = [f"train.max_steps={STEPS}", "metrics.tensorboard=false"]
NAMES = ["node0", "node1", "node2"]
UP = ["node0", "node1"]
CPUS = len(os.sched_getaffinity(0))  # what a host here reports as its CPU slots


def _env(**extra: str) -> dict[str, str]:
    """The launching node's environment: nothing inherited that would steer the network or ssh."""
    drop = ("SLURM_", "CUDA_VISIBLE", "NCCL_", "GLOO_", "PDSH_", "OMPI_", "DS_ENV_FILE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}
    return env | extra


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = namespace_problem()
    if why:
        pytest.skip(why)
    missing = missing_tools()
    if missing:  # a machine that can make hosts but lacks the packages is a broken setup, not a skip
        pytest.fail(f"missing {', '.join(missing)}: apt-get install openssh-server pdsh (see .ci/run)")
    with Cluster(tmp_path_factory.mktemp("hosts"), NAMES, down=["node2"]) as c:
        yield c
    assert c.leftovers() == [], "processes outlived the hosts"


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The same job as 4 ranks on one host, no hostfile: the losses multi-node must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    argv = [str(LAUNCH), "--stage", "3", "--gpus", "4", "--master-port", str(free_port()), "--",
            *TRAIN, f"train.run_dir={tmp / 'run'}"]  # fmt: skip
    r = subprocess.run(argv, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return _losses(tmp / "run")


def _launch(
    c: Cluster, args: list[str], cwd: Path, env: Mapping[str, str], timeout_s: float = 400
) -> tuple[int, str]:
    """launch.sh on node0; (exit code, output). Whatever happens, nothing may be left running."""
    log = cwd / "launch.log"
    with log.open("wb") as out:
        proc = c.popen("node0", [str(LAUNCH), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            c.kill_all()  # the launcher, pdsh/mpirun and every rank, on every host
            proc.kill()
            proc.wait()
            rc = -9
    left = c.settle()
    assert not left, f"left running after launch.sh exited: {left}"
    return rc, log.read_text(errors="replace")


def _rank_logs(run_dir: Path, world: int) -> dict[int, tuple[str, str, dict[str, str]]]:
    """rank -> (host, 'Python X /path, toolkit V', launch environment) from each rank's own log."""
    found = {}
    for rank in range(world):
        head = (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines()
        m = re.search(r" on (\S+) \(pid \d+\), (Python .*)$", head[0])
        assert m and head[1].startswith("launch environment: "), head[:2]
        found[rank] = (m.group(1), m.group(2), json.loads(head[1].removeprefix("launch environment: ")))
    return found


def _this_python() -> str:
    from toolkit import __version__

    return f"Python {platform.python_version()} {sys.executable}, toolkit {__version__}"


def _trains_on_two_hosts(c: Cluster, tmp: Path, reference: list[float], launcher: str,
                         env: dict[str, str], extra: list[str]) -> tuple[str, dict]:  # fmt: skip
    hostfile = c.hostfile(tmp / "hostfile", {"node0": 2, "node1": 2})
    run_dir = tmp / "run"
    args = ["--stage", "3", "--hostfile", str(hostfile), "--launcher", launcher, "--master-port", str(free_port()),
            "--", *TRAIN, f"train.run_dir={run_dir}", *extra]  # fmt: skip
    rc, out = _launch(c, args, tmp, env)
    assert rc == 0, out[-5000:]
    assert "world size: 4" in out and f"env: GLOO_SOCKET_IFNAME={IFACE}" in out, out[-5000:]
    runs = [p for p in tmp.iterdir() if p.name.startswith("run")]
    assert len(runs) == 1, runs
    assert _losses(runs[0]) == reference  # same world size, same data order: the same numbers
    ranks = _rank_logs(runs[0], 4)
    assert [ranks[r][0] for r in range(4)] == ["node0", "node0", "node1", "node1"], ranks
    assert {ranks[r][1] for r in range(4)} == {_this_python()}, ranks
    return out, ranks


@pytest.mark.timeout(600)
def test_pdsh_trains_on_two_hosts_like_one_host(
    cluster: Cluster, reference: list[float], tmp_path: Path
) -> None:
    # Allow-listed, and with a space and a `;`: the remote shell gets it inside double quotes
    # (`export HF_HOME="...";`) and must not run the touch.
    marker = tmp_path / "pwned"
    hf_home = f"{tmp_path}/hf home;touch {marker}"
    out, ranks = _trains_on_two_hosts(cluster, tmp_path, reference, "pdsh", _env(HF_HOME=hf_home), [])
    assert "cmd = pdsh -S" in out, out[-3000:]
    # node1's ranks start from sshd's clean environment: .deepspeed_env is their only source
    for rank in (2, 3):
        assert ranks[rank][2]["HF_HOME"] == hf_home, ranks[rank]
        assert ranks[rank][2]["GLOO_SOCKET_IFNAME"] == IFACE, ranks[rank]
    assert not marker.exists()


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="OpenMPI is not installed (apt-get install openmpi-bin)"
)
def test_openmpi_trains_on_two_hosts_and_passes_arguments_verbatim(
    cluster: Cluster, reference: list[float], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    # mpirun starts the ranks without a shell: this argument must arrive byte for byte
    hostile = f"train.run_dir={tmp_path}/run$(touch pwned)`touch pwned`"
    env = _env(HF_HOME=f"{tmp_path}/hf-home", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out, ranks = _trains_on_two_hosts(cluster, tmp_path, reference, "openmpi", env, [hostile])
    assert "cmd = mpirun" in out, out[-3000:]
    assert (tmp_path / "run$(touch pwned)`touch pwned`" / "metrics.jsonl").is_file()
    for rank in (2, 3):  # started by orted over ssh: only mpirun's -x carried these
        assert ranks[rank][2]["HF_HOME"] == f"{tmp_path}/hf-home", ranks[rank]
        assert ranks[rank][2]["GLOO_SOCKET_IFNAME"] == IFACE, ranks[rank]
    assert not marker.exists() and not (Path.home() / "pwned").exists()


def _other_python() -> Path | None:
    """An interpreter of another version than ours, to stand at our Python's path on node1."""
    for cand in sorted(Path("/usr/bin").glob("python3.*")):
        if re.fullmatch(r"python3\.\d+", cand.name) and cand.is_file():
            v = subprocess.run([cand, "-c", "import platform; print(platform.python_version())"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
            if v and v != platform.python_version():
                return cand
    return None


REFUSALS = {
    # case: (hostfile slots, extra env, expected line)
    "host down": ({"node0": 2, "node2": 2}, {}, "node2: not reachable over ssh (ssh: connect to host node2 port 22: Connection refused)"),
    "wrong interface": ({"node0": 2, "node1": 2}, {"GLOO_SOCKET_IFNAME": "eth0"},
                        f"GLOO_SOCKET_IFNAME=eth0 matches no interface on node0, node1 (interfaces there: lo, {IFACE})"),
    "slots above the host's": ({"node0": 2, "node1": CPUS + 1}, {},
                               f"node1: the launch puts {CPUS + 1} rank(s) there but it has {CPUS} CPU core(s)"),
    "other toolkit on node1": ({"node0": 2, "node1": 2}, {}, "node1 has toolkit 9.9.9+"),
    "other Python on node1": ({"node0": 2, "node1": 2}, {}, "node1 runs Python "),
}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["pdsh", "openmpi"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_preflight_refuses_before_any_rank_starts(
    cluster: Cluster, tmp_path: Path, case: str, launcher: str
) -> None:
    if launcher == "openmpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (apt-get install openmpi-bin)")
    slots, extra, expected = REFUSALS[case]
    hostfile = cluster.hostfile(tmp_path / "hostfile", slots)
    run_dir = tmp_path / "run"
    args = [
        "--stage",
        "3",
        "--hostfile",
        str(hostfile),
        "--launcher",
        launcher,
        "--",
        *TRAIN,
        f"train.run_dir={run_dir}",
    ]
    env = _env(**extra, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if case == "other toolkit on node1":
        init = ROOT / "toolkit" / "__init__.py"
        other = tmp_path / "other_init.py"
        other.write_text(re.sub(r'__version__ = "', '__version__ = "9.9.9+', init.read_text()))
        mount = cluster.bind("node1", other, init)
    elif case == "other Python on node1":
        python = _other_python()
        if python is None:
            pytest.skip(f"no Python other than {platform.python_version()} in /usr/bin to put on node1")
        mount = cluster.bind("node1", python, Path(os.path.realpath(sys.executable)))
    else:
        mount = contextlib.nullcontext()
    with mount:
        rc, out = _launch(cluster, args, tmp_path, env, timeout_s=240)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert rc != 0 and len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: ") and expected in errors[0], errors
    assert "command:" not in out and not run_dir.exists(), out[-3000:]  # DeepSpeed never started


HOSTILE = {
    # what the attacker controls -> (hostfile text, extra launch.sh arguments)
    "command substitution as host": ("$(touch {m}) slots=1\nnode1 slots=1\n", []),
    "ssh option as host": ("-oProxyCommand=touch${{IFS}}{m} slots=1\nnode1 slots=1\n", []),
    "command after host": ("node0;touch${{IFS}}{m} slots=1\nnode1 slots=1\n", []),
    "argument after --": ("node0 slots=1\nnode1 slots=1\n", ["--", "train.run_dir=x;touch {m}"]),
    "substitution after --": ("node0 slots=1\nnode1 slots=1\n", ["--", "train.run_dir=$(touch {m})"]),
    "master address": ("node0 slots=1\nnode1 slots=1\n", ["--master-addr", "$(touch {m})"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_hostfile_or_argument_runs_nowhere(cluster: Cluster, tmp_path: Path, case: str) -> None:
    marker = tmp_path / "pwned"
    text, extra = HOSTILE[case]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text.format(m=marker))
    before = {n: cluster.sessions(n) for n in UP}
    args = ["--stage", "2", "--hostfile", str(hostfile), *[a.format(m=marker) for a in extra]]
    if "--" not in args:
        args += ["--", *TRAIN]
    rc, out = _launch(cluster, args, tmp_path, _env(), timeout_s=90)
    assert rc != 0 and "error" in out, out
    assert not marker.exists()
    assert {n: cluster.sessions(n) for n in UP} == before, "refused, yet something logged in to a host"
    if "host" in case:  # the pre-flight command refuses the same hostfile, equally without ssh
        argv = [sys.executable, "-m", "toolkit", "env", "--no-build", "--hostfile", str(hostfile)]
        r = subprocess.run(cluster.argv("node0", argv, cwd=tmp_path), env=_env(PYTHONPATH=str(ROOT)),
                           capture_output=True, text=True, timeout=90)  # fmt: skip
        assert r.returncode == 1 and "bad host name" in r.stdout, r.stdout + r.stderr
        assert {n: cluster.sessions(n) for n in UP} == before and not marker.exists()


@pytest.mark.timeout(120)
def test_toolkit_env_reports_each_host(cluster: Cluster, tmp_path: Path) -> None:
    hostfile = cluster.hostfile(tmp_path / "hostfile", {"node0": 2, "node1": 2, "node2": 1})

    def env(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "toolkit", "env", "--no-build", "--hostfile", str(hostfile), *args]
        return subprocess.run(cluster.argv("node0", argv, cwd=tmp_path), env=_env(PYTHONPATH=str(ROOT)),
                              capture_output=True, text=True, timeout=100)  # fmt: skip

    r = env("--json")
    assert r.returncode == 1, r.stdout + r.stderr  # node2 is down
    report = json.loads(r.stdout)
    assert report["master"] == "10.77.0.1" and report["interface"] == IFACE
    for i, name in enumerate(UP):
        host = report["hosts"][name]
        assert host["ok"] and host["host"] == name, host
        assert (host["python"], host["executable"]) == (platform.python_version(), sys.executable)
        assert host["toolkit"] and host["torch"] and host["deepspeed"], host
        assert host["route"] == {"src": f"10.77.0.{i + 1}", "iface": IFACE}, host
    assert report["hosts"]["node2"]["ok"] is False
    assert [e for e in report["errors"] if "node2" in e] == report["errors"] != [], report["errors"]

    cluster.hostfile(hostfile, {"node0": 2, "node1": 2})
    text = env()
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"master 10.77.0.1, interface to use: {IFACE}" in text.stdout, text.stdout
    node1 = next(line for line in text.stdout.splitlines() if line.strip().startswith("node1 "))
    assert (
        " ok " in node1
        and f"interface {IFACE} 10.77.0.2" in node1
        and f"Python {platform.python_version()}" in node1
    )
