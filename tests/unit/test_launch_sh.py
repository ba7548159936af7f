"""launch.sh through subprocess: config choice, world size, verbatim arguments, errors."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch.sh"
DS = REPO / "ds_configs"
TRAIN = REPO / "toolkit" / "train.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    # DS_ACCELERATOR=cpu makes launch.sh take CPU mode on any machine (GPU count 0).
    env |= {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable}
    env |= extra
    return env


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LAUNCH), *args], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )


def fields(out: str) -> dict[str, str]:
    result = {}
    for line in out.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            result[key] = value
    return result


def command(out: str) -> list[str]:
    return shlex.split(fields(out)["command"])


EXPECTED = {
    (0, "none"): "zero0",
    (1, "none"): "zero1",
    (2, "none"): "zero2",
    (3, "none"): "zero3",
    (0, "optimizer"): None,
    (1, "optimizer"): "zero1_offload",
    (2, "optimizer"): "zero2_offload",
    (3, "optimizer"): "zero3_offload_optimizer",
    (0, "all"): None,
    (1, "all"): None,
    (2, "all"): None,
    (3, "all"): "zero3_offload",
    (0, "nvme"): None,
    (1, "nvme"): None,
    (2, "nvme"): None,
    (3, "nvme"): "zero3_offload_nvme",
}


@pytest.mark.parametrize(("stage", "offload"), sorted(EXPECTED))
def test_dry_run_picks_config(stage: int, offload: str, tmp_path: Path) -> None:
    r = run("--stage", str(stage), "--offload", offload, "--dry-run", cwd=tmp_path)
    name = EXPECTED[(stage, offload)]
    if name is None:
        assert r.returncode == 2, r.stdout + r.stderr
        assert "needs" in r.stderr and "usage:" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    f = fields(r.stdout)
    expected_file = DS / f"{name}.json"
    assert f["config"] == str(expected_file)
    assert f["world size"] == "2"  # no GPU: CPU mode with 2 ranks
    argv = command(r.stdout)
    assert argv[argv.index("--ds") + 1] == str(expected_file)
    assert argv[argv.index("--num_gpus") + 1] == "2"
    assert "train.path=trainer" in argv
    if not expected_file.exists():  # generated on a real run, never on a dry run
        assert f"--stage {stage}" in f["would generate"]
        assert not expected_file.exists()
    assert f["would check"].endswith(f"check {expected_file} --world-size 2 --path trainer")


def test_world_size_gpus_and_hostfile(tmp_path: Path) -> None:
    r = run("--stage", "2", "--gpus", "4", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert fields(r.stdout)["world size"] == "4"
    assert command(r.stdout)[1:3] == ["--num_gpus", "4"]

    hf = tmp_path / "hosts"
    hf.write_text("# two nodes\nworker-1 slots=4\nworker-2 slots=4\n")
    r = run("--stage", "3", "--hostfile", str(hf), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert fields(r.stdout)["world size"] == "8"
    argv = command(r.stdout)
    assert argv[argv.index("--hostfile") + 1] == str(hf)
    assert "--num_gpus" not in argv
    assert "would write" in fields(r.stdout)  # .deepspeed_env for a multi-node launch

    r = run(
        "--stage", "3", "--hostfile", str(hf), "--include", "worker-1:0,1@worker-2", "--dry-run", cwd=tmp_path
    )
    assert fields(r.stdout)["world size"] == "6"
    r = run("--stage", "3", "--hostfile", str(hf), "--gpus", "2", "--dry-run", cwd=tmp_path)
    assert fields(r.stdout)["world size"] == "4"


def test_bad_hostfile_fails_with_line(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("worker-1 slots=4\nworker-2 slots=0\n")
    r = run("--stage", "2", "--hostfile", str(hf), "--dry-run", cwd=tmp_path)
    assert r.returncode == 1
    assert f"{hf}:2:" in r.stderr


def test_hostile_values_arrive_verbatim(tmp_path: Path) -> None:
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    cfg = tmp_path / f"a b;touch {marker.name};'\"x.yaml"
    cfg.write_text("{}\n")
    hostile = [
        f"note=$(touch {marker})",
        f"note2=`touch {marker}`",
        f"x=1;touch {marker}",
        "y=a b  c",
        "z=*",
        "w='\"",
    ]
    r = run("--stage", "1", "--config", cfg.name, "--dry-run", "--", *hostile, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    argv = command(r.stdout)
    assert argv[argv.index("--config") + 1] == cfg.name
    assert argv[-len(hostile) :] == hostile
    assert not marker.exists()


def _fake_tools(tmp_path: Path, check_rc: int) -> tuple[dict[str, str], Path]:
    """A `deepspeed` that records its argv, and a python whose `-m toolkit check` returns check_rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    ds = bin_dir / "deepspeed"
    ds.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    py = bin_dir / "python-wrapper"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1 $2 $3" == "-m toolkit check" ]]; then echo "fake check"; exit {check_rc}; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    for f in (ds, py):
        f.chmod(0o755)
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(py))
    return env, record


def test_real_run_passes_argv_verbatim(tmp_path: Path) -> None:
    env, record = _fake_tools(tmp_path, check_rc=0)
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    hostile = [f"note=$(touch {marker})", f"x=1;rm -rf {marker}", "train.max_steps=5"]
    r = run("--stage", "2", "--path", "raw", "--", *hostile, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())
    assert argv == [
        "--num_gpus",
        "2",
        str(TRAIN),
        "--ds",
        str(DS / "zero2.json"),
        "train.path=raw",
        *hostile,
    ]
    assert command(r.stdout)[1:] == argv
    assert not marker.exists()
    assert not (tmp_path / ".deepspeed_env").exists()  # local launch: no env file


def test_failed_check_aborts(tmp_path: Path) -> None:
    env, record = _fake_tools(tmp_path, check_rc=1)
    r = run("--stage", "2", cwd=tmp_path, env=env)
    assert r.returncode == 1
    assert "toolkit check rejected" in r.stderr
    assert not record.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--stage", "2", "--bogus"], "unknown argument '--bogus'"),
        (["--stage"], "--stage needs a value"),
        (["--stage", "2", "--config"], "--config needs a value"),
        (["--stage", "--dry-run"], "--stage needs a value"),
        (["--stage", "4"], "--stage must be 0, 1, 2 or 3"),
        (["--stage", "x"], "--stage must be 0, 1, 2 or 3"),
        (["--dry-run"], "--stage is required"),
        (["--stage", "2", "--offload", "gpu"], "--offload must be"),
        (["--stage", "2", "--gpus", "0"], "--gpus must be a positive integer"),
        (["--stage", "2", "--gpus", "2", "--include", "localhost:0"], "cannot be combined"),
        (["--stage", "2", "--launcher", "ssh"], "--launcher must be"),
        (["--stage", "2", "--path", "fast"], "--path must be"),
        (["--stage", "2", "--no-ssh"], "--no-ssh needs --node-rank"),
        (["--stage", "2", "--node-rank", "1"], "only makes sense with --no-ssh"),
        (["--stage", "2", "stray"], "unknown argument 'stray'"),
    ],
)
def test_usage_errors(args: list[str], needle: str, tmp_path: Path) -> None:
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stdout
    assert needle in r.stderr
    assert "usage:" in r.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    r = run("--stage", "2", "--config", "nope.yaml", "--dry-run", cwd=tmp_path)
    assert r.returncode == 1 and "no such file: nope.yaml" in r.stderr


def test_equals_form_and_help(tmp_path: Path) -> None:
    r = run("--stage=3", "--offload=all", "--gpus=3", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert fields(r.stdout)["world size"] == "3"
    assert fields(r.stdout)["config"].endswith("zero3_offload.json")
    h = run("--help", cwd=tmp_path)
    assert h.returncode == 0 and "--stage" in h.stdout


def test_no_ssh(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=2\nnode-b slots=2\n")
    args = ["--stage", "2", "--hostfile", str(hf), "--no-ssh", "--master-addr", "10.0.0.1", "--dry-run"]
    r = run(*args, "--node-rank", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    argv = command(r.stdout)
    i = argv.index("--no_ssh")
    assert argv[i : i + 7] == [
        "--no_ssh",
        "--node_rank",
        "1",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "29500",
    ]
    assert fields(r.stdout)["world size"] == "4"
    assert "would write" not in fields(r.stdout)  # DeepSpeed reads .deepspeed_env only via pdsh/mpi/slurm
    bad = run(*args, "--node-rank", "2", cwd=tmp_path)
    assert bad.returncode == 1 and "out of range" in bad.stderr
    no_addr = run("--stage", "2", "--hostfile", str(hf), "--no-ssh", "--node-rank", "0", cwd=tmp_path)
    assert no_addr.returncode == 2 and "--master-addr" in no_addr.stderr


def test_slurm(tmp_path: Path) -> None:
    env = _env(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_GPUS_ON_NODE="4", PATH=os.environ["PATH"])
    r = run("--stage", "3", "--launcher", "slurm", "--dry-run", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert fields(r.stdout)["world size"] == "8"
    argv = command(r.stdout)
    assert argv[argv.index("--launcher") + 1] == "slurm"
    assert argv[argv.index("--master_addr") + 1] == "gpu01"
    assert "--no_ssh_check" in argv
    assert not Path(argv[argv.index("--hostfile") + 1]).exists()  # temp hostfile cleaned up
    missing = run("--stage", "3", "--launcher", "slurm", "--dry-run", cwd=tmp_path)
    assert missing.returncode == 1 and "SLURM_JOB_NODELIST" in missing.stderr


def test_pdsh_refuses_shell_characters(tmp_path: Path) -> None:
    # pdsh runs DeepSpeed's command line through a remote shell: refuse rather than execute.
    hf = tmp_path / "hosts"
    hf.write_text("worker-1 slots=1\nworker-2 slots=1\n")
    r = run("--stage", "2", "--hostfile", str(hf), "--dry-run", "--", "x=$(id)", cwd=tmp_path)
    assert r.returncode == 1 and "remote shell" in r.stderr
    ok = run(
        "--stage",
        "2",
        "--hostfile",
        str(hf),
        "--launcher",
        "openmpi",
        "--dry-run",
        "--",
        "x=$(id)",
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr


def test_shell_syntax() -> None:
    subprocess.run(["bash", "-n", str(LAUNCH)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(LAUNCH)], check=True)


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TRAIN.exists(), reason="toolkit/train.py does not exist yet")
def test_real_launch_stage2_cpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with socket.socket() as s:  # other DeepSpeed jobs on this machine may hold 29500
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = ["--stage", "2", "--master-port", port, "--", "train.max_steps=3", f"train.run_dir={run_dir}"]
    r = run(*args, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert (run_dir / "metrics.jsonl").exists()
