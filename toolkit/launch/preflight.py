"""Multi-node pre-flight: ssh to every host before any rank starts, and refuse a launch that would fail.

DeepSpeed's pdsh and openmpi launchers check only that the first host answers ssh. Everything else
shows up after the ranks have started (and on a GPU cluster, after the model has loaded), as a
hang or as one traceback among many: a host down, a Python or toolkit that differs on one node, a
launch directory missing there, an NCCL/GLOO_SOCKET_IFNAME that names no interface there, more
slots in the hostfile than the host has GPUs. Here one small Python program (`PROBE`) runs on
every host through the same ssh that pdsh and mpirun use, with the interpreter DeepSpeed will
start there (its own `sys.executable`), and reports what it finds; `problems` turns the reports
into one line per problem.

The first active host is the master: its address is the one the launching node reached it at over
ssh (unless --master-addr says otherwise), and every other host must reach it. The interface
each host uses to get there is "the interface to use"; on CPU runs launch.sh exports it as
GLOO_SOCKET_IFNAME when every host names it alike (gloo otherwise binds whatever the hostname
resolves to, often 127.0.1.1).

`python -m toolkit.launch.preflight` is what launch.sh runs: the host report goes to stderr, and on
success `master_addr=` and `interface=` lines to stdout for the launcher.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError, run_command

REPO = Path(__file__).resolve().parents[2]

# Runs on every host as `python - ARGS_JSON` (program on stdin, so nothing but a JSON string goes
# through the remote shell). Plain Python 3.6 syntax: it must run, and report, on an older
# interpreter too. It imports only the toolkit package (import-free) and psutil.
PROBE = r"""
import hashlib, json, os, platform, shutil, socket, subprocess, sys
args = json.loads(sys.argv[1])
out = {"host": socket.gethostname(), "python": platform.python_version(), "executable": sys.executable,
       "ssh_connection": os.environ.get("SSH_CONNECTION"), "cwd_ok": os.path.isdir(args["cwd"])}
try:
    out["cpus"] = len(os.sched_getaffinity(0))
except AttributeError:
    out["cpus"] = os.cpu_count()
out["gpus"] = None
smi = shutil.which("nvidia-smi")
if smi:
    try:
        listing = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30)
        out["gpus"] = sum(1 for x in listing.stdout.decode(errors="replace").splitlines() if x.startswith("GPU "))
    except Exception:
        pass
try:
    from importlib import metadata
    def _version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    out["torch"], out["deepspeed"] = _version("torch"), _version("deepspeed")
except ImportError:
    out["torch"] = out["deepspeed"] = None
sys.path.insert(0, args["repo"])
try:
    import toolkit
    out["toolkit"] = getattr(toolkit, "__version__", "unknown")
    out["toolkit_path"] = os.path.dirname(os.path.abspath(toolkit.__file__))
    digest = hashlib.sha256()  # every .py file, by relative path: equal on two hosts iff the source is
    sources = sorted(os.path.relpath(os.path.join(root, f), out["toolkit_path"])
                     for root, _, files in os.walk(out["toolkit_path"]) for f in files if f.endswith(".py"))
    for rel in sources:
        with open(os.path.join(out["toolkit_path"], rel), "rb") as f:
            digest.update(rel.encode() + b"\0" + f.read() + b"\0")
    out["toolkit_digest"] = digest.hexdigest()[:12]
except Exception as e:
    out["toolkit"] = None
    out["toolkit_error"] = "%s: %s" % (type(e).__name__, e)
ifaces = {}
try:
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        ifaces[name] = [a.address for a in addrs if a.family == socket.AF_INET]
except ImportError:
    ifaces = {name: [] for _, name in socket.if_nameindex()}
out["interfaces"] = ifaces
master = args.get("master")
if master == "@ssh":  # the address this host was reached at: the launching node's view of it
    conn = (os.environ.get("SSH_CONNECTION") or "").split()
    master = out["master"] = conn[2] if len(conn) == 4 else None
if master:
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect((master, 9))  # UDP: picks the route and source address, sends nothing
        src = probe.getsockname()[0]
        probe.close()
        out["route"] = {"src": src, "iface": next((n for n, a in ifaces.items() if src in a), None)}
    except OSError as e:
        out["route"] = {"error": str(e)}
    if args.get("master_port_check"):
        try:
            socket.create_connection((master, args["master_port_check"]), timeout=5).close()
            out["master_reachable"] = True
        except OSError as e:
            out["master_reachable"] = str(e)
if args.get("bind_port"):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does: only a listener blocks
    try:
        s.bind(("", args["bind_port"]))
        out["port_free"] = True
    except OSError as e:
        out["port_free"] = str(e)
    finally:
        s.close()
print(json.dumps(out))
"""

_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.:-]+$")


def _ssh_argv(host: str, remote: str, timeout_s: float, extra: Sequence[str]) -> list[str]:
    # BatchMode: a password or passphrase prompt fails at once, as it does under pdsh.
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, math.ceil(timeout_s))}",
            *extra, "--", host, remote]  # fmt: skip


def probe(host: str | None, args: Mapping[str, Any], python: str, timeout_s: float,
          ssh_extra: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """Run PROBE on `host` over ssh (None: here, without ssh). Returns its report, or
    {"ok": False, "detail": why} when ssh or the interpreter failed."""
    payload = json.dumps(dict(args))
    if host is None:
        argv = [python, "-", payload]
    else:
        argv = _ssh_argv(host, f"exec {shlex.quote(python)} - {shlex.quote(payload)}", timeout_s, ssh_extra)
    try:
        proc = subprocess.run(argv, input=PROBE, capture_output=True, text=True, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        return {"ok": False, "stage": "ssh", "detail": f"no answer within {timeout_s + 60:g} s"}
    except OSError as e:  # no ssh client here, or (host None) no such interpreter
        return {"ok": False, "stage": "ssh" if host else "python", "detail": str(e)}
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    if proc.returncode == 255 and host is not None:  # ssh's own failure code
        return {"ok": False, "stage": "ssh", "detail": lines[-1] if lines else "ssh exit 255"}
    if proc.returncode != 0:
        why = lines[-1] if lines else f"exit {proc.returncode}"
        return {"ok": False, "stage": "python", "detail": f"{python} failed there: {why}"}
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "stage": "python", "detail": f"unreadable answer: {proc.stdout[-200:]!r}"}
    return {"ok": True, "detail": "ok", **report}


def selected_interfaces(key: str, spec: str, names: Sequence[str]) -> list[str]:
    """Interfaces a *_SOCKET_IFNAME value selects among `names`.

    GLOO_SOCKET_IFNAME: exact names, comma-separated. NCCL_SOCKET_IFNAME: prefixes (`eth`
    matches eth0), `=name` for exact names, a leading `^` to exclude.
    """
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if key.startswith("GLOO"):
        return [n for n in names if n in entries]
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.lstrip("^")
    exact = text.startswith("=")
    entries = [e.strip() for e in text.lstrip("=").split(",") if e.strip()]
    hit = [n for n in names if (n in entries if exact else any(n.startswith(e) for e in entries))]
    return [n for n in names if n not in hit] if exclude else hit


def _ssh_port(first: Mapping[str, Any]) -> int | None:
    conn = (first.get("ssh_connection") or "").split()
    return int(conn[3]) if len(conn) == 4 and conn[3].isdigit() else None


def needed_slots(hosts: Mapping[str, int], include: str | None, num_gpus: int | None) -> dict[str, int]:
    """Slots a launch uses on each active host: --num_gpus on every host, else the highest slot
    index --include names (+1), else the hostfile's count."""
    from toolkit.launch.hostfile import parse_include

    if num_gpus is not None:
        return dict.fromkeys(hosts, num_gpus)
    if not include:
        return dict(hosts)
    chosen = parse_include(include)
    return {h: (max(chosen[h]) + 1 if chosen[h] else n) for h, n in hosts.items() if h in chosen}


def problems(local: Mapping[str, Any], reports: Mapping[str, Mapping[str, Any]], slots: Mapping[str, int],
             accelerator: str, environ: Mapping[str, str], launcher: str = "pdsh",
             master: str | None = None, master_port: int | None = None) -> list[str]:  # fmt: skip
    """One line per problem that would break the launch; [] when every host is fit to run."""
    out: list[str] = []
    # (variable, value, what is wrong) -> hosts: the same mistake on every host is one line
    bad_iface: dict[tuple[str, str, str], list[tuple[str, Mapping[str, Any]]]] = {}
    cpu = accelerator == "cpu"
    tool = "mpirun" if launcher == "openmpi" else "pdsh"
    for host, r in reports.items():
        if not r.get("ok"):
            if r.get("stage") == "ssh":
                out.append(f"{host}: not reachable over ssh ({r['detail']}); {tool} needs passwordless "
                           f"ssh from this node to every host: `ssh {host} true` must work")  # fmt: skip
            else:
                out.append(f"{host}: {r['detail']}; every host needs the same Python at the same path")
            continue
        same_python = all(r.get(k) == local.get(k) for k in ("python", "executable"))
        if not same_python:
            out.append(f"{host} runs Python {r.get('python')} ({r.get('executable')}), this node "
                       f"{local.get('python')} ({local.get('executable')}): every host needs the same Python "
                       f"at the same path (DeepSpeed starts {local.get('executable')} there)")  # fmt: skip
        if r.get("toolkit") is None:
            out.append(f"{host}: cannot import the toolkit from {local.get('toolkit_path')} "
                       f"({r.get('toolkit_error')}); put the same checkout at the same path on every host")  # fmt: skip
        elif (r.get("toolkit"), r.get("toolkit_digest"), r.get("toolkit_path")) != (
            local.get("toolkit"),
            local.get("toolkit_digest"),
            local.get("toolkit_path"),
        ):
            out.append(f"{host} has toolkit {r.get('toolkit')} (source {r.get('toolkit_digest')}) in "
                       f"{r.get('toolkit_path')}, this node {local.get('toolkit')} (source "
                       f"{local.get('toolkit_digest')}) in {local.get('toolkit_path')}: check out the same "
                       "version at the same path on every host")  # fmt: skip
        for pkg in ("torch", "deepspeed") if same_python else ():  # another Python: its packages differ too
            if r.get(pkg) != local.get(pkg):
                out.append(f"{host} has {pkg} {r.get(pkg) or '(not installed)'}, this node {local.get(pkg)}: "
                           "install the same version on every host")  # fmt: skip
        if not r.get("cwd_ok"):
            out.append(f"{host}: the launch directory {local.get('cwd')} does not exist there (DeepSpeed "
                       "runs every rank from it); launch from a directory every host has")  # fmt: skip
        names = sorted(r.get("interfaces") or {})
        for key in ("GLOO_SOCKET_IFNAME", *(() if cpu else ("NCCL_SOCKET_IFNAME",))):
            spec = environ.get(key, "").strip()
            if not spec:
                continue
            chosen = selected_interfaces(key, spec, names)
            if not chosen:
                bad_iface.setdefault((key, spec, "matches no interface"), []).append((host, r))
            elif len(reports) > 1 and all(_loopback(r, n) for n in chosen):
                bad_iface.setdefault((key, spec, "selects only loopback"), []).append((host, r))
        route = r.get("route") or {}
        if "error" in route:
            out.append(f"{host}: no route to the master {master}: {route['error']}")
        elif r.get("master_reachable") not in (None, True):
            out.append(f"{host}: cannot reach the master {master} (ssh port test: {r['master_reachable']})")
        if r.get("port_free") not in (None, True):
            out.append(f"{host}: master port {master_port} is in use there ({r['port_free']}); "
                       "pass --master-port with a free port")  # fmt: skip
        need = slots.get(host)
        if need is None:
            continue
        if cpu:
            have, unit = r.get("cpus"), "CPU core(s) (DS_ACCELERATOR=cpu: one rank per core at most)"
        else:
            have, unit = r.get("gpus") or 0, "GPU(s) (nvidia-smi -L)"
        if have is not None and need > have:
            out.append(f"{host}: the launch puts {need} rank(s) there but it has {have} {unit}; "
                       f"lower its slots in the hostfile to {have}")  # fmt: skip
    for (key, spec, what), where in bad_iface.items():
        have = sorted({n for _, r in where for n in r.get("interfaces") or {}})
        routes = sorted(
            {
                str((r.get("route") or {}).get("iface"))
                for _, r in where
                if (r.get("route") or {}).get("iface")
            }
        )
        hint = f"; the master is reached through {', '.join(routes)}" if routes else ""
        out.append(f"{key}={spec} {what} on {', '.join(h for h, _ in where)} (interfaces there: "
                   f"{', '.join(have)}){hint}")  # fmt: skip
    return out


def _loopback(report: Mapping[str, Any], iface: str) -> bool:
    addrs = (report.get("interfaces") or {}).get(iface) or []
    return iface == "lo" or (bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs))


def common_interface(reports: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The interface every reachable host reaches the master through, when they all name it alike."""
    names = {(r.get("route") or {}).get("iface") for r in reports.values() if r.get("ok")}
    if len(names) != 1:
        return None
    name = names.pop()
    return name if name and _SAFE_VALUE.match(name) else None


def run_preflight(hosts: Sequence[str], slots: Mapping[str, int], *, accelerator: str, launcher: str = "pdsh",
                  master: str | None = None, master_port: int | None = None, cwd: str | None = None,
                  timeout_s: float = 10.0, python: str = sys.executable,
                  environ: Mapping[str, str] = os.environ) -> dict[str, Any]:  # fmt: skip
    """Probe this node and every host (the first one first: it names the master), then judge.

    Returns {"local", "hosts": {host: report}, "master", "interface", "problems"}.
    """
    cwd = cwd or os.getcwd()
    ssh_extra = shlex.split(environ.get("PDSH_SSH_ARGS_APPEND", "")) if launcher == "pdsh" else []
    base = {"repo": str(REPO), "cwd": cwd}
    local = probe(None, base, python, timeout_s)
    local["cwd"] = cwd
    if not local.get("ok"):
        raise ConfigError(f"the pre-flight probe failed on this node: {local['detail']}")
    reports: dict[str, dict[str, Any]] = {}
    first, rest = hosts[0], list(hosts[1:])
    first_args = dict(base, bind_port=master_port or 29500, master=master or "@ssh")
    reports[first] = probe(first, first_args, python, timeout_s, ssh_extra)
    master = master or reports[first].get("master")
    args = dict(base)
    if master:
        args["master"] = master
        port = _ssh_port(reports[first]) if reports[first].get("ok") else None
        if port:
            args["master_port_check"] = port
    if rest:
        with ThreadPoolExecutor(max_workers=min(32, len(rest))) as pool:
            answers = list(pool.map(lambda h: probe(h, args, python, timeout_s, ssh_extra), rest))
        reports.update(zip(rest, answers, strict=True))
    found = problems(local, reports, slots, accelerator, environ, launcher, master, master_port or 29500)
    return {"local": local, "hosts": reports, "master": master, "interface": common_interface(reports),
            "problems": found}  # fmt: skip


def describe(host: str, r: Mapping[str, Any], slots: int | None = None, accelerator: str = "cpu") -> str:
    """One line per host for people: reachable, versions, interface to use, slots."""
    if not r.get("ok"):
        return f"{host:<16} FAIL  {r.get('detail')}"
    route = r.get("route") or {}
    iface = f"{route.get('iface')} {route.get('src')}" if route.get("iface") else "(master unknown)"
    cap = f"{r.get('cpus')} CPUs" if accelerator == "cpu" else f"{r.get('gpus') or 0} GPUs"
    used = f"{slots} slots of {cap}" if slots is not None else cap
    return (f"{host:<16} ok    Python {r.get('python')}  toolkit {r.get('toolkit')} ({r.get('toolkit_digest')})  "
            f"torch {r.get('torch')}  deepspeed {r.get('deepspeed')}  interface {iface}  {used}")  # fmt: skip


def _main(argv: list[str] | None = None) -> int:
    from toolkit.launch.hostfile import active_hosts, parse_hostfile

    ap = argparse.ArgumentParser(prog="python -m toolkit.launch.preflight", description=__doc__.splitlines()[0])
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--include", default=None)
    ap.add_argument("--num-gpus", type=int, default=None)
    ap.add_argument("--launcher", choices=("pdsh", "openmpi"), default="pdsh")
    ap.add_argument("--master-addr", default=None)
    ap.add_argument("--master-port", type=int, default=None)
    ap.add_argument("--ssh-timeout", type=float, default=10.0)
    a = ap.parse_args(argv)
    pool = parse_hostfile(a.hostfile)
    hosts = active_hosts(pool, a.include)
    slots = needed_slots({h: pool[h] for h in hosts}, a.include, a.num_gpus)
    accel = "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" else "cuda"
    result = run_preflight(hosts, slots, accelerator=accel, launcher=a.launcher, master=a.master_addr,
                           master_port=a.master_port, timeout_s=a.ssh_timeout)  # fmt: skip
    for line in result["problems"]:
        print(f"error: {line}", file=sys.stderr)
    if result["problems"]:
        return 1
    for host, r in result["hosts"].items():
        print(f"host {describe(host, r, slots.get(host), accel)}", file=sys.stderr)
    master = result["master"] or ""
    if master and not _SAFE_VALUE.match(master):
        raise ConfigError(f"unexpected master address {master!r}")
    print(f"master_addr={master}")
    print(f"interface={result['interface'] or ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
