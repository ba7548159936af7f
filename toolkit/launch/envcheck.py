"""`toolkit env`: pre-flight checks before a (multi-node) DeepSpeed launch.

Versions, GPUs, whether DeepSpeed's optimizer ops build, TORCH_CUDA_ARCH_LIST entries DeepSpeed
cannot parse, NCCL_* variables (and an NCCL_SOCKET_IFNAME naming no interface here), and with
--hostfile the launch's pre-flight (toolkit/launch/preflight.py) on every host: reachable over ssh in
batch mode, the same Python, toolkit, torch and DeepSpeed as here, the interface it reaches the
first host through, its slots. Exit 1 only for hard failures: a hostfile that does not parse or a
host the launch would fail on; everything else is a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.launch.cuda_arch import ENV_VAR as ARCH_VAR
from toolkit.launch.cuda_arch import sanitize_cuda_arch_list, unparseable_arch_entries

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "datasets", "accelerate")


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    versions |= {name: _pkg_version(name) for name in PACKAGES}
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
    except ImportError:
        versions["cuda"] = None
    return versions


def collect_gpus() -> tuple[list[dict[str, Any]], list[str]]:
    """GPUs torch can use (name, total memory); NVML as a fallback to explain a CPU-only torch."""
    warnings: list[str] = []
    gpus: list[dict[str, Any]] = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(
                    {
                        "index": i,
                        "name": props.name,
                        "total_gib": round(props.total_memory / 2**30, 2),
                        "capability": f"{props.major}.{props.minor}",
                    }
                )
            return gpus, warnings
    except ImportError:
        warnings.append("torch is not installed")
        return gpus, warnings
    with contextlib.suppress(Exception):  # no driver / no pynvml: simply no GPUs
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            for i in range(n):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                gpus.append(
                    {"index": i, "name": str(name), "total_gib": round(mem.total / 2**30, 2), "torch": False}
                )
        finally:
            pynvml.nvmlShutdown()
        if gpus:
            warnings.append(
                f"NVML sees {len(gpus)} GPU(s) but torch.cuda does not: CPU-only torch build or driver mismatch"
            )
    return gpus, warnings


def check_cuda_arch(environ: Mapping[str, str]) -> dict[str, Any]:
    value = environ.get(ARCH_VAR)
    result: dict[str, Any] = {"value": value, "unparseable": [], "fix": None}
    if value is None:
        return result
    bad = unparseable_arch_entries(value)
    if bad:
        trial = dict(environ)
        sanitize_cuda_arch_list(trial)
        new = trial.get(ARCH_VAR)
        result["unparseable"] = bad
        result["fix"] = (
            f"export {ARCH_VAR}={shlex.quote(new)}" if new else f"unset {ARCH_VAR}"
        ) + " (toolkit/train.py applies this itself; other DeepSpeed programs need it done)"
    return result


def interface_names() -> list[str]:
    try:
        import psutil

        return sorted(psutil.net_if_addrs())
    except ImportError:
        return sorted(name for _, name in socket.if_nameindex())


def check_nccl(environ: Mapping[str, str], interfaces: list[str]) -> tuple[dict[str, str], list[str]]:
    """NCCL_* variables, and a warning for NCCL_SOCKET_IFNAME entries that match no interface.

    NCCL's syntax: comma-separated prefixes (`eth` matches eth0), `=name` for an exact name,
    a leading `^` to exclude. An entry matching nothing makes NCCL fail at init with
    "no socket interface found", usually after the job has been queued and loaded its model.
    """
    nccl = {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_")}
    warnings: list[str] = []
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        spec = environ.get(key, "").strip()
        if not spec or spec.startswith("^"):
            continue
        exact = spec.startswith("=")
        entries = [e.strip() for e in spec.lstrip("=").split(",") if e.strip()]
        for entry in entries:
            hit = entry in interfaces if exact else any(i.startswith(entry) for i in interfaces)
            if not hit:
                warnings.append(
                    f"{key}={spec}: no interface {'named' if exact else 'starting with'} {entry!r} on "
                    f"{socket.gethostname()} (have {', '.join(interfaces) or 'none'})"
                )
    return nccl, warnings


def check_ops(build: bool, cuda: bool) -> dict[str, dict[str, Any]]:
    """is_compatible() for CPUAdam and FusedAdam, and a real JIT load (cached after the first)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    results: dict[str, dict[str, Any]] = {}
    for op, cls in (("cpu_adam", "CPUAdamBuilder"), ("fused_adam", "FusedAdamBuilder")):
        info: dict[str, Any] = {"compatible": None, "built": None, "seconds": None, "error": None}
        results[op] = info
        try:
            builder = accel.create_op_builder(cls)
        except Exception as e:  # the builder module itself may fail to import
            info["error"] = f"{type(e).__name__}: {e}"
            continue
        if builder is None:
            info["error"] = f"accelerator {accel.device_name()} has no {cls}"
            continue
        try:
            info["compatible"] = bool(builder.is_compatible(verbose=False))
        except Exception as e:
            info["compatible"] = False
            info["error"] = f"{type(e).__name__}: {e}"
        want = build and info["compatible"] and (op == "cpu_adam" or cuda)
        if not want:
            info["skipped"] = (
                "--no-build" if not build else ("no CUDA" if op == "fused_adam" else "not compatible")
            )
            continue
        start = time.perf_counter()
        try:
            builder.load(verbose=False)
            info["built"] = True
        except Exception as e:  # report, do not crash: this is a diagnostic
            info["built"] = False
            info["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        info["seconds"] = round(time.perf_counter() - start, 2)
    return results


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """DeepSpeed logs and ninja print on fd 1; keep stdout clean for --json."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"warnings": [], "errors": []}
    warn, err = report["warnings"].append, report["errors"].append

    report["cuda_arch"] = check_cuda_arch(os.environ)
    if report["cuda_arch"]["unparseable"]:
        bad = ", ".join(report["cuda_arch"]["unparseable"])
        warn(
            f"{ARCH_VAR}={report['cuda_arch']['value']}: DeepSpeed cannot parse {bad}; {report['cuda_arch']['fix']}"
        )
    # Build the ops the way train.py will run them: with the list sanitized.
    sanitize_cuda_arch_list(os.environ)

    report["versions"] = collect_versions()
    for name in ("torch", "deepspeed"):
        if report["versions"].get(name) is None:
            err(f"{name} is not installed")
    report["gpus"], gpu_warnings = collect_gpus()
    report["warnings"].extend(gpu_warnings)
    cuda = any(g.get("torch", True) for g in report["gpus"])

    report["ops"] = {}
    if report["versions"].get("deepspeed"):
        try:
            import deepspeed.accelerator as dsa

            report["accelerator"] = dsa.get_accelerator().device_name()
            report["ops"] = check_ops(build=not args.no_build, cuda=cuda)
        except Exception as e:
            warn(f"DeepSpeed op checks failed: {type(e).__name__}: {e}")
    for op, info in report["ops"].items():
        if info.get("built") is False or (info.get("compatible") is False and op == "cpu_adam"):
            warn(
                f"{op} cannot be built: {info.get('error') or 'not compatible'} (optimizer offload needs cpu_adam)"
            )

    report["nccl"], nccl_warnings = check_nccl(os.environ, interface_names())
    report["warnings"].extend(nccl_warnings)

    report["hosts"] = None
    if args.hostfile:
        from toolkit.launch.hostfile import parse_hostfile

        try:
            pool = parse_hostfile(args.hostfile)
        except ConfigError as e:
            err(str(e))
            return report
        report["hostfile"] = args.hostfile
        hosts = list(pool)
        report["slots"] = dict(pool)
        if shutil.which("ssh") is None:
            warn(
                "ssh is not installed: cannot check the hosts (pdsh and DeepSpeed's multi-node runners need it)"
            )
            report["hosts"] = {h: {"ok": None, "detail": "ssh not installed"} for h in hosts}
        else:
            # The launch's own pre-flight: every host over ssh in batch mode, its versions against
            # this node's, the interface it reaches the first host (the master) through, its slots.
            from toolkit.launch.preflight import run_preflight

            cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or report.get("accelerator") == "cpu"
            report["slots_of"] = "cpu" if cpu else "cuda"
            try:
                found = run_preflight(hosts, pool, accelerator=report["slots_of"],
                                      timeout_s=args.ssh_timeout)  # fmt: skip
            except ConfigError as e:
                err(str(e))
                return report
            report["hosts"] = found["hosts"]
            report["master"], report["interface"] = found["master"], found["interface"]
            for problem in found["problems"]:
                err(problem)
        if len(hosts) > 1 and shutil.which("pdsh") is None:
            warn(
                "pdsh is not installed: DeepSpeed's default multi-node launcher needs it "
                "(install pdsh, or use --launcher openmpi/slurm, or --no-ssh per node)"
            )
    return report


def format_text(report: dict[str, Any]) -> str:
    lines: list[str] = []
    v = report.get("versions", {})
    for name in ("python", *PACKAGES, "cuda"):
        if name in v:
            missing = "none (CPU build)" if name == "cuda" else "not installed"
            lines.append(f"{name:<14}{v[name] or missing}")
    if "accelerator" in report:
        lines.append(f"{'accelerator':<14}{report['accelerator']}")
    gpus = report.get("gpus") or []
    lines.append(f"{'GPUs':<14}{len(gpus) or 'none'}")
    lines += [f"  [{g['index']}] {g['name']}  {g['total_gib']:.1f} GiB" for g in gpus]
    for op, info in (report.get("ops") or {}).items():
        if info.get("built"):
            state = f"built ({info['seconds']} s)"
        elif info.get("built") is False:
            state = f"BUILD FAILED: {info.get('error')}"
        else:
            state = f"not built ({info.get('skipped') or info.get('error')})"
        compat = {True: "compatible", False: "NOT compatible", None: "unknown"}[info.get("compatible")]
        lines.append(f"{'op ' + op:<14}{compat}, {state}")
    arch = report.get("cuda_arch") or {}
    if arch.get("value") is not None:
        bad = arch.get("unparseable")
        lines.append(
            f"{ARCH_VAR}={arch['value']}"
            + (f"  unparseable: {', '.join(bad)}; {arch['fix']}" if bad else "  ok")
        )
    nccl = report.get("nccl") or {}
    lines.append(f"{'NCCL_*':<14}" + (" ".join(f"{k}={val}" for k, val in nccl.items()) or "none set"))
    if report.get("hosts") is not None:
        from toolkit.launch.preflight import describe

        master = f", master {report['master']}" if report.get("master") else ""
        iface = f", interface to use: {report['interface']}" if report.get("interface") else ""
        lines.append(f"hosts ({report.get('hostfile')}{master}{iface}):")
        for host, a in report["hosts"].items():
            if a["ok"] is None:
                lines.append(f"  {host:<16} unchecked  {a['detail']}")
            else:
                lines.append("  " + describe(host, a, report["slots"].get(host), report.get("slots_of", "cpu")))
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [f"error: {e}" for e in report["errors"]]
    lines.append("result: " + ("FAIL" if report["errors"] else "ok"))
    return "\n".join(lines)


def run_env(args: argparse.Namespace) -> int:
    if args.ssh_timeout <= 0:
        raise ConfigError(f"--ssh-timeout must be > 0, got {args.ssh_timeout}")
    if args.json:
        with _stdout_to_stderr():
            report = collect(args)
        report["ok"] = not report["errors"]
        print(json.dumps(report, indent=2, default=str))
    else:
        report = collect(args)
        print(format_text(report))
    return 1 if report["errors"] else 0
