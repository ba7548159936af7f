"""Several hosts on one machine for multi-node tests: Linux namespaces, a bridge, a real sshd on each.

Each host is one holder process (`unshare ... sleep infinity`) owning its own
- network namespace: one veth `tk0` with 10.77.0.N/24, plugged into a bridge that lives in a
  namespace of its own (the "switch"). The machine's own network never sees any of it, and the
  hosts reach nothing but each other;
- UTS namespace: its own hostname (node0, node1, ...), as `hostname -I`, OpenMPI and gloo expect;
- mount namespace: its own /etc/hosts (every host's name and address), /etc/ssh/ssh_config (the
  test's key pair, a known_hosts with each host's key, so strict host key checking stays on) and a
  tmpfs on /run (sshd's privilege separation directory). Everything else is the shared filesystem:
  every host sees the same Python and the same checkout, as on a cluster with a shared home;
- PID namespace: the holder is the host's PID 1, so killing it ends every process of the host
  (sshd, launchers, ranks started over ssh). The holder dies with the test process
  (PR_SET_PDEATHSIG), so even a killed pytest leaves no host, sshd or rank behind.

A host listed in `down` gets its namespaces and address but no sshd: a machine that is up and
answers nothing on port 22.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"  # private to the switch namespace; the machine's own routes never see it
IFACE = "tk0"  # deliberately not eth0: DeepSpeed's openmpi runner assumes eth0
TOOLS = ("unshare", "nsenter", "ip", "ssh", "ssh-keygen", "pdsh")
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself and wants an absolute path
_NSENTER = ("--net", "--uts", "--mount", "--pid")
_PR_SET_PDEATHSIG = 1
# The host's PID 1 reaps every orphan (`sleep` would not: exited ssh sessions and MPI daemons would
# stay zombies) and does nothing else.
_INIT = (
    "import os, signal\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
    "while True:\n"
    "    try:\n"
    "        while os.waitpid(-1, os.WNOHANG)[0] > 0:\n"
    "            pass\n"
    "    except ChildProcessError:\n"
    "        pass\n"
    "    signal.sigwait({signal.SIGCHLD})\n"
)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the test process dies, whatever way it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _run(argv: Sequence[str], timeout_s: float = 30) -> str:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def missing_tools() -> list[str]:
    found = [t for t in TOOLS if shutil.which(t) is None]
    return found + ([] if Path(SSHD).is_file() else [SSHD])


def namespace_problem() -> str | None:
    """Why this machine cannot make the hosts (None when it can): root, and a trial of every kind
    of namespace and device the harness uses."""
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to make network, mount and PID namespaces"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is missing (util-linux, iproute2)"
    trial = (
        "ip link add name tkt0 type veth peer name tkt1 && ip link add name tkb0 type bridge "
        "&& ip link set tkt0 master tkb0 && mount -t tmpfs tmpfs /run && hostname tk-trial"
    )
    argv = ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
            "--propagation", "private", "sh", "-c", trial]  # fmt: skip
    try:
        _run(argv, timeout_s=20)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        return f"cannot make namespaces here: {e}"
    return None


def _ns_inode(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Host:
    name: str
    addr: str
    holder: subprocess.Popen  # `unshare --fork`: stays in the root PID namespace
    init_pid: int = 0  # the host's PID 1 (global PID), whose namespaces everything enters
    sshd: subprocess.Popen | None = None  # nsenter; sshd itself is its child inside the host
    sshd_log: Path | None = None
    ns: dict[str, str] = field(default_factory=dict)  # namespace inodes, to find processes later


class Cluster:
    """`with Cluster(workdir, ["node0", "node1"]) as c:` hosts with sshd, ready for ssh, pdsh, mpirun."""

    def __init__(self, workdir: Path, names: Sequence[str], down: Sequence[str] = ()) -> None:
        self.dir = Path(workdir)
        self.names = list(names)
        self.down = set(down)
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.hosts: dict[str, Host] = {}
        self.switch: subprocess.Popen | None = None
        self.switch_ns = ""

    # -- setup ---------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _keygen(path: Path) -> tuple[str, str]:
        """A new ed25519 key pair at `path`; returns (type, base64) of the public half."""
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tk-harness", "-f", str(path)])
        key_type, key = path.with_name(path.name + ".pub").read_text().split()[:2]
        return key_type, key

    def _write_files(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        key_type, key = self._keygen(self.dir / "id_ed25519")
        (self.dir / "authorized_keys").write_text(f"{key_type} {key}\n")
        addrs = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(self.names)}
        known = []
        for name in self.names:
            host_type, host_key = self._keygen(self.dir / f"host_{name}")
            known.append(f"{name},{addrs[name]} {host_type} {host_key}\n")
            (self.dir / f"sshd_{name}.conf").write_text(
                "\n".join([
                    "Port 22", "ListenAddress 0.0.0.0", f"HostKey {self.dir}/host_{name}", "PidFile none",
                    f"AuthorizedKeysFile {self.dir}/authorized_keys",
                    "StrictModes no",  # the key files live under /tmp, which sshd's mode check refuses
                    "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password", "UsePAM no", "PrintMotd no", "PrintLastLog no",
                    "UseDNS no", "LogLevel INFO", "",
                ])
            )  # fmt: skip
        (self.dir / "known_hosts").write_text("".join(known))
        (self.dir / "etc_hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in addrs.items())
        )
        # The client side, as a person would put it in ~/.ssh/config; no ssh_config.d includes.
        (self.dir / "ssh_config").write_text(
            "\n".join([
                "Host *", f"    User {self.user}", f"    IdentityFile {self.dir}/id_ed25519",
                "    IdentitiesOnly yes", f"    UserKnownHostsFile {self.dir}/known_hosts",
                "    GlobalKnownHostsFile /dev/null", "    StrictHostKeyChecking yes",
                "    PasswordAuthentication no", "    ConnectTimeout 5", "    LogLevel ERROR", "",
            ])
        )  # fmt: skip
        for name in self.names:
            self.hosts[name] = Host(name, addrs[name], holder=None)  # type: ignore[arg-type]

    def _start(self) -> None:
        self._write_files()
        self.switch = subprocess.Popen(
            ["unshare", "--net", "sleep", "infinity"], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL
        )
        for name in self.names:
            host = self.hosts[name]
            host.holder = subprocess.Popen(
                ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                 "--propagation", "private", sys.executable, "-c", _INIT],
                preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        sw = str(self.switch.pid)
        self._wait_exec(self.switch.pid)
        self.switch_ns = _ns_inode(self.switch.pid, "net") or ""
        _run(["nsenter", "-t", sw, "--net", "ip", "link", "add", "name", "br0", "type", "bridge"])
        _run(["nsenter", "-t", sw, "--net", "ip", "link", "set", "br0", "up"])
        for i, name in enumerate(self.names):
            host = self.hosts[name]
            host.init_pid = self._wait_child(host.holder.pid)
            host.ns = {k: _ns_inode(host.init_pid, k) or "" for k in ("net", "pid", "mnt")}
            pid = str(host.init_pid)
            _run(["nsenter", "-t", sw, "--net", "ip", "link", "add", "name", f"p{i}", "type", "veth",
                  "peer", "name", IFACE, "netns", pid])  # fmt: skip
            _run(["nsenter", "-t", sw, "--net", "ip", "link", "set", f"p{i}", "master", "br0", "up"])
            self.sh(
                name, f"ip link set lo up && ip addr add {host.addr}/24 dev {IFACE} && ip link set {IFACE} up"
            )
            self.sh(name, f"hostname {name}")
            mounts = [
                "mount -t tmpfs tmpfs /run", "mkdir -m 0755 /run/sshd",
                f"mount --bind {self.dir}/etc_hosts /etc/hosts",
                f"mount --bind {self.dir}/ssh_config /etc/ssh/ssh_config",
            ]  # fmt: skip
            home_ssh = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
            if home_ssh.is_dir():  # the real user's ssh files must not leak into the hosts
                mounts.append(f"mount -t tmpfs tmpfs {home_ssh}")
            self.sh(name, " && ".join(mounts))
            if name not in self.down:
                self._start_sshd(host)
        for host in self.hosts.values():
            if host.sshd is not None:
                self._wait_listening(host)

    @staticmethod
    def _wait_exec(pid: int, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while Path(f"/proc/{pid}/comm").read_text().strip() == "unshare":
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace holder {pid} did not start")
            time.sleep(0.02)

    def _wait_child(self, pid: int, timeout_s: float = 10) -> int:
        """The forked PID 1 of the host, once it has mounted /proc and exec'ed its init."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if children and Path(f"/proc/{children[0]}/comm").read_text().strip() != "unshare":
                    return int(children[0])
            time.sleep(0.02)
        raise RuntimeError(f"namespace holder {pid} did not fork its PID 1")

    def _start_sshd(self, host: Host) -> None:
        host.sshd_log = self.dir / f"sshd_{host.name}.log"
        with host.sshd_log.open("wb") as log:
            host.sshd = subprocess.Popen(
                ["nsenter", "-t", str(host.init_pid), *_NSENTER, "--", SSHD, "-D", "-e",
                 "-f", str(self.dir / f"sshd_{host.name}.conf")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},  # sessions start from sshd's own clean env
            )  # fmt: skip

    @staticmethod
    def _wait_listening(host: Host, timeout_s: float = 15) -> None:
        assert host.sshd is not None and host.sshd_log is not None
        deadline = time.monotonic() + timeout_s
        while "Server listening on 0.0.0.0 port 22" not in host.sshd_log.read_text(errors="replace"):
            if host.sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} did not start:\n{host.sshd_log.read_text()}")
            time.sleep(0.05)

    # -- use -----------------------------------------------------------------------------------

    def argv(self, name: str, argv: Sequence[str], cwd: Path | str | None = None) -> list[str]:
        """`argv` run inside host `name` (all four namespaces), from `cwd`."""
        wd = [f"--wd={cwd}"] if cwd is not None else []
        return ["nsenter", "-t", str(self.hosts[name].init_pid), *_NSENTER, *wd, "--", *argv]

    def sh(self, name: str, script: str, timeout_s: float = 30) -> str:
        return _run(self.argv(name, ["sh", "-c", script]), timeout_s=timeout_s)

    def popen(
        self, name: str, argv: Sequence[str], cwd: Path | str, env: Mapping[str, str], **kw: Any
    ) -> subprocess.Popen:
        return subprocess.Popen(self.argv(name, argv, cwd), env=dict(env), stdin=subprocess.DEVNULL, **kw)

    def hostfile(self, path: Path, slots: Mapping[str, int]) -> Path:
        path.write_text("".join(f"{h} slots={n}\n" for h, n in slots.items()))
        return path

    def sessions(self, name: str) -> int:
        """ssh logins this host's sshd has accepted so far (its log says so, one line each)."""
        log = self.hosts[name].sshd_log
        return (
            0 if log is None else len(re.findall(r"Accepted publickey for ", log.read_text(errors="replace")))
        )

    def processes(self, name: str) -> list[str]:
        """Every process of host `name` except its PID 1 and sshd's listener: launchers, ranks,
        ssh sessions. Empty when nothing runs there."""
        host = self.hosts[name]
        keep = {host.init_pid}
        if host.sshd is not None:
            with contextlib.suppress(OSError):
                keep |= {
                    int(p)
                    for p in Path(f"/proc/{host.sshd.pid}/task/{host.sshd.pid}/children").read_text().split()
                }
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in keep:
                continue
            if _ns_inode(int(entry.name), "pid") == host.ns["pid"]:
                found.append(f"{entry.name} {_cmdline(int(entry.name))}")
        return found

    def settle(self, names: Sequence[str] | None = None, timeout_s: float = 15) -> dict[str, list[str]]:
        """Wait until the hosts run nothing (ssh sessions take a moment to close); what is left."""
        names = list(names or self.names)
        deadline = time.monotonic() + timeout_s
        while True:
            left = {n: p for n in names if (p := self.processes(n))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_all(self) -> None:
        """SIGKILL whatever runs on any host (a launch that overran its time), sshd excepted."""
        for name in self.names:
            for entry in self.processes(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.split()[0]), signal.SIGKILL)

    @contextlib.contextmanager
    def bind(self, name: str, src: Path, dst: Path) -> Iterator[None]:
        """`src` seen at `dst` on host `name` only (another Python or checkout on one node)."""
        self.sh(name, f"mount --bind {src} {dst}")
        try:
            yield
        finally:
            self.sh(name, f"umount {dst}")

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host's PID 1 (the kernel then kills everything in that host) and the switch;
        the namespaces go with their last process."""
        for host in self.hosts.values():
            if host.init_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.init_pid, signal.SIGKILL)
            for proc in (host.holder, host.sshd):
                if proc is None:
                    continue
                # Each exits once its child is gone, after reaping it: killing them first would
                # leave the host's PID 1 a zombie for the machine's init to collect.
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if self.switch is not None:
            self.switch.kill()
            self.switch.wait(timeout=10)

    def leftovers(self) -> list[str]:
        """Processes still in any of the hosts' namespaces (after close(): none, or a leak)."""
        inodes = {ns for h in self.hosts.values() for ns in h.ns.values() if ns} | {self.switch_ns} - {""}
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                pid = int(entry.name)
                if any(_ns_inode(pid, k) in inodes for k in ("net", "pid", "mnt")):
                    found.append(f"{pid} {_cmdline(pid)}")
        return found
