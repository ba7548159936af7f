"""Strict hostfile parsing, --include, Slurm node lists and .deepspeed_env."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config.ds_config import ConfigError
from toolkit.launch.hostfile import (
    HostfileError,
    deepspeed_env_vars,
    expand_nodelist,
    parse_hostfile,
    parse_hostfile_text,
    parse_include,
    slurm_hosts,
    slurm_slots,
    world_size,
    write_deepspeed_env,
)

REPO = Path(__file__).resolve().parents[2]


def test_good_file_with_comments(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text(
        "# cluster\n\nworker-1 slots=8\n  worker-2\tslots=4   # trailing comment\n#worker-3 slots=2\n"
    )
    assert parse_hostfile(f) == {"worker-1": 8, "worker-2": 4}
    assert list(parse_hostfile(f)) == ["worker-1", "worker-2"]  # order = rank order


def test_example_file_parses() -> None:
    assert parse_hostfile(REPO / "hostfile.example") == {"worker-1": 8, "worker-2": 8}


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("worker-2", "missing slots"),
        ("worker-2 slots=0", "slots=0"),
        ("worker-2 slots=-1", "positive integer"),
        ("worker-2 slots=4abc", "positive integer"),
        ("worker-2 slots=", "positive integer"),
        ("worker-2 slots=2.5", "positive integer"),
        ("worker-2 slots = 4", "expected `slots=N`"),
        ("worker-2 max_slots=4", "expected `slots=N`"),
        ("worker-2 slots=4 max_slots=8", "unexpected"),
        ("worker-2 slots=4 slots=8", "unexpected"),
        ("worker:2 slots=4", "bad host name"),
        ("a@b slots=4", "bad host name"),
        ("node[1-2] slots=4", "bad host name"),
        ("worker-1 slots=2", "duplicate host 'worker-1' (first on line 2)"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    f = tmp_path / "hosts"
    f.write_text(f"# header\nworker-1 slots=8\n{line}\n")
    with pytest.raises(HostfileError) as info:
        parse_hostfile(f)
    assert f"{f}:3:" in str(info.value)
    assert needle in str(info.value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_no_hosts_is_an_error(text: str) -> None:
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile_text(text, "hf")


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    # DeepSpeed only warns and trains on localhost alone.
    with pytest.raises(HostfileError, match="not found"):
        parse_hostfile(tmp_path / "nope")


def test_agrees_with_deepspeed_on_good_files_and_is_stricter_where_documented() -> None:
    runner = pytest.importorskip("deepspeed.launcher.runner")
    good = "# c\nworker-1 slots=8\n\nworker-2 slots=4 # note\n"
    assert dict(runner._parse_hostfile(good.splitlines())) == parse_hostfile_text(good)
    for silently_accepted in ("w slots=4abc", "w slots=0", "w slots=4 max_slots=8"):
        runner._parse_hostfile([silently_accepted])  # DeepSpeed: no error
        with pytest.raises(HostfileError):
            parse_hostfile_text(silently_accepted)


def test_parse_include() -> None:
    assert parse_include("host1:0,1@host2") == {"host1": [0, 1], "host2": []}
    assert parse_include("h:1@h:0") == {"h": [0, 1]}
    for bad in ("", "h:", "h:a", "h:0,,1", ":0"):
        with pytest.raises(HostfileError):
            parse_include(bad)


def test_world_size() -> None:
    hosts = {"a": 4, "b": 4}
    assert world_size(hosts) == 8
    assert world_size(hosts, num_gpus=2) == 4
    assert world_size(hosts, include="a:0,1@b") == 6
    assert world_size(hosts, include="b:3") == 1
    with pytest.raises(HostfileError, match="not in the hostfile"):
        world_size(hosts, include="c")
    with pytest.raises(HostfileError, match=r"slots 0\.\.3"):
        world_size(hosts, include="a:4")
    with pytest.raises(HostfileError, match="cannot be combined"):
        world_size(hosts, include="a", num_gpus=1)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a,b,a", ["a", "b"]),
        ("node[001-002].cluster", ["node001.cluster", "node002.cluster"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
    assert slurm_hosts(nodelist, use_scontrol=False) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[3-1]", "node[a-b]", "", " , "])
def test_slurm_nodelist_errors(bad: str) -> None:
    with pytest.raises(HostfileError):
        slurm_hosts(bad, use_scontrol=False)


def test_slurm_slots() -> None:
    assert slurm_slots({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert slurm_slots({"SLURM_GPUS_PER_NODE": "h100:8"}) == 8
    assert slurm_slots({}) is None


SECRET_ENV = {
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret",
    "WANDB_API_KEY": "secret",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "GITHUB_TOKEN": "secret",
    "NCCL_FAKE_TOKEN": "secret",
    "SSH_AUTH_SOCK": "/tmp/agent",
    "HOME": "/root",
    "PATH": "/usr/bin",
    "CUDA_VISIBLE_DEVICES": "0,1",
}
GOOD_ENV = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    "PYTHONPATH": "/opt/a:/opt/b",
    "HF_HOME": "/data/hf",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCH_CUDA_ARCH_LIST": "9.0;8.0",
    "DS_ACCELERATOR": "cuda",
    "OMP_NUM_THREADS": "4",
    "CUDA_HOME": "/usr/local/cuda",
}


def _read_like_deepspeed(path: Path) -> dict[str, str]:
    """runner.main: `key, val = line.split('=', maxsplit=1)` for every line; then strip."""
    out = {}
    for line in path.read_text().splitlines(keepends=True):
        key, val = line.split("=", maxsplit=1)
        out[key.strip()] = val.strip()
    return out


def test_deepspeed_env_allow_list_excludes_secrets(tmp_path: Path) -> None:
    path = tmp_path / ".deepspeed_env"
    keys = write_deepspeed_env(path, SECRET_ENV | GOOD_ENV)
    assert sorted(keys) == sorted(GOOD_ENV)
    assert _read_like_deepspeed(path) == GOOD_ENV
    text = path.read_text()
    assert "secret" not in text and "CUDA_VISIBLE_DEVICES" not in text and "PATH=/usr/bin" not in text


def test_deepspeed_env_skips_values_a_remote_shell_would_run(tmp_path: Path) -> None:
    env = {"NCCL_DEBUG": "INFO", "HF_HOME": "$(touch /tmp/x)", "PYTHONPATH": "a`id`", "NCCL_ALGO": 'a"b'}
    chosen, skipped = deepspeed_env_vars(env)
    assert chosen == {"NCCL_DEBUG": "INFO"}
    assert sorted(skipped) == ["HF_HOME", "NCCL_ALGO", "PYTHONPATH"]


def test_deepspeed_env_keeps_user_lines(tmp_path: Path) -> None:
    path = tmp_path / ".deepspeed_env"
    path.write_text("MY_VAR=1\nNCCL_DEBUG=WARN\n\n")
    write_deepspeed_env(path, {"NCCL_DEBUG": "INFO"})
    assert _read_like_deepspeed(path) == {"MY_VAR": "1", "NCCL_DEBUG": "INFO"}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "toolkit.launch.hostfile", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
    )


def test_cli_world_size_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("a slots=4\nb slots=4\n")
    assert _cli("world-size", "--hostfile", str(f)).stdout.strip() == "8"
    assert _cli("world-size", "--hostfile", str(f), "--include", "a:0@b").stdout.strip() == "5"
    assert _cli("world-size", "--hostfile", str(f), "--num-gpus", "2").stdout.strip() == "4"
    f.write_text("a slots=4\nb slots=x\n")
    bad = _cli("world-size", "--hostfile", str(f))
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and f"{f}:2:" in bad.stderr


def test_cli_slurm_hostfile(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    env = {"SLURM_JOB_NODELIST": "node[01-02],gpu5", "SLURM_GPUS_ON_NODE": "4", "PATH": "/usr/bin:/bin"}
    r = _cli("slurm-hostfile", "-o", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert parse_hostfile(out) == {"node01": 4, "node02": 4, "gpu5": 4}
    r = _cli("slurm-hostfile", env={"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": ""})
    assert r.returncode == 1 and "--slots" in r.stderr
