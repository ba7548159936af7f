"""Hostfiles, `--include` specs, Slurm node lists and `.deepspeed_env`, for launch.sh and `toolkit env`.

Stricter than DeepSpeed on purpose. DeepSpeed 0.19.8 (`deepspeed/launcher/runner.py`,
`fetch_hostfile` / `_parse_hostfile`) matches each line with `re.search(r'^(\\S+)\\s+slots=(\\d+)')`:

- a missing hostfile only logs a warning and the job quietly trains on localhost alone
  (a typo in `--hostfile` turns a 4-node run into a 1-node run): we raise;
- anything after the slot count is ignored, so `worker-1 slots=4abc`, `worker-1 slots=4 slots=8`
  or `worker-1 slots=8 max_slots=16` all launch with a number the author did not mean: we raise;
- `slots=0` is accepted and yields a host that is in the world info but runs nothing: we raise;
- its errors print the whole file but no line number: ours name `file:line` and the problem;
- host names with `:`, `@`, `,` or `[` `]` are accepted there but break `--include`
  (`host:0,1@host2`) and pdsh's `-w` list: we raise.
Comments (`#` to end of line, also after an entry) and blank lines are fine in both.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from toolkit.config.ds_config import ConfigError, run_command


class HostfileError(ConfigError):
    """A hostfile, include spec or node list the toolkit refuses; the message names the place."""


_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SLOTS = re.compile(r"^slots=(.*)$")


def parse_hostfile_text(text: str, name: str = "<hostfile>") -> dict[str, int]:
    """`host slots=N` per line -> {host: N} in file order (rank order follows it)."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        tokens = line.split()
        host = tokens[0]
        if not _HOST.match(host):
            raise HostfileError(
                f"{where}: bad host name {host!r} (letters, digits, '.', '-', '_' only; "
                f"':' '@' ',' '[' break --include and pdsh)"
            )
        if len(tokens) == 1:
            raise HostfileError(f"{where}: missing slots for {host!r}; write `{host} slots=N`")
        m = _SLOTS.match(tokens[1])
        if not m:
            raise HostfileError(f"{where}: expected `slots=N` after {host!r}, got {tokens[1]!r}")
        if len(tokens) > 2:
            extra = " ".join(tokens[2:])
            raise HostfileError(
                f"{where}: unexpected {extra!r} after `{host} {tokens[1]}` "
                "(DeepSpeed would silently ignore it; remove it or make it a # comment)"
            )
        if not re.fullmatch(r"[0-9]+", m.group(1)):
            raise HostfileError(f"{where}: slots must be a positive integer, got {m.group(1)!r}")
        slots = int(m.group(1))
        if slots < 1:
            raise HostfileError(f"{where}: slots=0 for {host!r}; remove the line or give it >= 1 slot")
        if host in hosts:
            raise HostfileError(f"{where}: duplicate host {host!r} (first on line {first_line[host]})")
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        raise HostfileError(f"{name}: no hosts (every line is blank or a comment)")
    return hosts


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse a hostfile; a missing file is an error (DeepSpeed would fall back to localhost)."""
    p = Path(path)
    if not p.is_file():
        raise HostfileError(f"{path}: hostfile not found")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HostfileError(f"{path}: cannot read hostfile: {e}") from None
    return parse_hostfile_text(text, str(path))


def parse_include(spec: str) -> dict[str, list[int]]:
    """DeepSpeed's `--include` syntax `host1:0,1@host2` -> {host1: [0, 1], host2: []} ([] = all slots).

    Same rules as deepspeed.launcher.runner.parse_node_config_list (a host named twice merges its
    slots), but a malformed spec raises here instead of an int() traceback there.
    """
    result: dict[str, list[int]] = {}
    if not spec.strip():
        raise HostfileError("empty --include spec")
    for node in spec.split("@"):
        host, sep, slot_text = node.partition(":")
        if not _HOST.match(host):
            raise HostfileError(f"--include {spec!r}: bad host {host!r} in {node!r}")
        slots: list[int] = []
        if sep:
            for s in slot_text.split(","):
                if not re.fullmatch(r"[0-9]+", s):
                    raise HostfileError(f"--include {spec!r}: bad slot {s!r} for {host!r} (want host:0,1)")
                slots.append(int(s))
        result[host] = sorted(set(result.get(host, []) + slots))
    return result


def world_size(hosts: Mapping[str, int], include: str | None = None, num_gpus: int | None = None) -> int:
    """Ranks the DeepSpeed launcher will start for this resource pool.

    Mirrors runner.main: --include selects hosts/slots (a bare host means all its slots);
    --num_gpus N gives every host N ranks. The two cannot be combined (DeepSpeed refuses too).
    """
    if include and num_gpus is not None:
        raise HostfileError("--include and --num-gpus cannot be combined (DeepSpeed refuses it)")
    if num_gpus is not None:
        if num_gpus < 1:
            raise HostfileError(f"--num-gpus must be >= 1, got {num_gpus}")
        return num_gpus * len(hosts)
    if not include:
        return sum(hosts.values())
    total = 0
    for host, slots in parse_include(include).items():
        if host not in hosts:
            raise HostfileError(
                f"--include names {host!r}, which is not in the hostfile ({', '.join(hosts)})"
            )
        bad = [s for s in slots if s >= hosts[host]]
        if bad:
            raise HostfileError(f"--include: {host!r} has slots 0..{hosts[host] - 1}, not {bad}")
        total += len(slots) if slots else hosts[host]
    return total


def active_hosts(hosts: Mapping[str, int], include: str | None = None) -> list[str]:
    """Hosts a launch runs on, in hostfile order (DeepSpeed keeps that order for ranks)."""
    if not include:
        return list(hosts)
    world_size(hosts, include)  # validates the spec against the hostfile
    chosen = parse_include(include)
    return [h for h in hosts if h in chosen]


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: `a[1-2,5],b` -> ['a[1-2,5]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostfileError(f"node list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostfileError(f"node list {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        if not re.fullmatch(r"[0-9]+", lo) or (dash and not re.fullmatch(r"[0-9]+", hi)):
            raise HostfileError(f"node list {whole!r}: bad range {item!r}")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise HostfileError(f"node list {whole!r}: range {item!r} runs backwards")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound: node[01-03]
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        if "[" in pattern or "]" in pattern or not _HOST.match(pattern):
            raise HostfileError(f"node list {whole!r}: bad host {pattern!r}")
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [h for n in _expand_range(m.group(1), whole) for h in _expand_one(head + n + tail, whole)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Pure-Python expansion of the common Slurm forms: `node[01-03,07],gpu5`, `r[1-2]-n[1-2]`."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        for h in _expand_one(part, nodelist):
            if h not in hosts:
                hosts.append(h)
    if not hosts:
        raise HostfileError(f"node list {nodelist!r} names no hosts")
    return hosts


def slurm_hosts(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Expand SLURM_JOB_NODELIST into host names.

    `scontrol show hostnames` is the authority (it knows every hostlist form Slurm accepts and
    the cluster's own quirks), so use it inside an allocation. The small expander covers the
    usual forms for login nodes or containers without the Slurm client, and for tests.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise HostfileError("SLURM_JOB_NODELIST is empty: run inside a Slurm allocation (salloc/sbatch)")
    scontrol = shutil.which("scontrol") if use_scontrol else None
    if scontrol:
        proc = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
        if proc.returncode == 0 and proc.stdout.split():
            return proc.stdout.split()
    return expand_nodelist(nodelist)


def slurm_slots(environ: Mapping[str, str]) -> int | None:
    """GPUs per node from Slurm's environment (SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE `[type:]N`)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "").strip()
        m = re.fullmatch(r"(?:[^:,]+:)?([0-9]+)", value)
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return None


def format_hostfile(hosts: Mapping[str, int]) -> str:
    return "".join(f"{h} slots={n}\n" for h, n in hosts.items())


# ---- .deepspeed_env ----------------------------------------------------------------------
#
# How DeepSpeed 0.19.8 reads it (runner.main): only for multi-node launches through a backend
# (pdsh, openmpi, mpich, impi, mvapich, slurm); never for a local or --no_ssh launch. It opens
# os.path.join(dir, os.getenv("DS_ENV_FILE", ".deepspeed_env")) for dir in [~, "."] (both; the
# cwd file is applied last so it wins), and for every line does `key, val = line.split("=", 1)`:
# no comments, no blank lines (a line without '=' kills the launcher). Values are stripped and
# wrapped in double quotes when they hold anything outside [\w@%+=:,./-]; under pdsh they land in
# `export K="v";` run by the remote shell, so `$`, backticks, `"` and `\` would be evaluated
# there: such values are skipped here. Under openmpi the same quoted value goes to `mpirun -x K="v"`
# as one argument, no shell: the ranks would get the quote characters as part of the value
# (seen with OpenMPI 4.1), so for openmpi every value DeepSpeed would quote is skipped.

ENV_ALLOW_EXACT = frozenset(
    {
        "PYTHONPATH",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TORCH_CUDA_ARCH_LIST",
        # where every node's ranks keep their caches: DeepSpeed's built ops, inductor's kernels, the XDG cache (Hugging
        # Face, matplotlib, torch) and the toolkit's own (tokenized data, model shapes); without them a rank started
        # over ssh writes into the login user's ~/.cache
        "TORCH_EXTENSIONS_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "XDG_CACHE_HOME",
        "TOOLKIT_CACHE",
        "DS_ACCELERATOR",
        "OMP_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "CUDA_HOME",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_DEVICE_ORDER",
    }
)
# NCCL_* / TORCH_NCCL_* tune the interconnect; FI_* configures libfabric (AWS EFA); GLOO_* picks
# gloo's interface (GLOO_SOCKET_IFNAME: CPU runs, and gloo groups on GPU runs).
ENV_ALLOW_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "GLOO_")
# Per node/rank, set by the launcher itself: copying rank 0's value would break the others.
ENV_DENY_EXACT = frozenset({"CUDA_VISIBLE_DEVICES", "NCCL_COMM_ID"})
# Defence in depth: nothing that looks like a credential, whatever the prefix.
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|API_?KEY|PRIVATE", re.IGNORECASE)
_UNSAFE_VALUE = re.compile(r"[$`\"\\\n\r]")
# What DeepSpeed's MultiNodeRunner.add_export leaves unquoted.
_PLAIN_VALUE = re.compile(r"^[\w@%+=:,./-]*$")


def deepspeed_env_path(environ: Mapping[str, str], cwd: str | Path = ".") -> Path:
    """The cwd copy DeepSpeed reads last (DS_ENV_FILE may rename it or make it absolute)."""
    return Path(cwd) / environ.get("DS_ENV_FILE", ".deepspeed_env")


def allow_listed(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that `.deepspeed_env` may carry, judged by name alone."""
    return {
        key: environ[key]
        for key in sorted(environ)
        if key not in ENV_DENY_EXACT
        and not _SECRET.search(key)
        and (key in ENV_ALLOW_EXACT or key.startswith(ENV_ALLOW_PREFIXES))
    }


def deepspeed_env_vars(
    environ: Mapping[str, str], launcher: str = "pdsh"
) -> tuple[dict[str, str], list[str]]:
    """(allow-listed variables to export, names skipped because their value would not arrive intact)."""
    chosen: dict[str, str] = {}
    skipped: list[str] = []
    for key, value in allow_listed(environ).items():
        if _UNSAFE_VALUE.search(value) or (launcher == "openmpi" and not _PLAIN_VALUE.match(value.strip())):
            skipped.append(key)
            continue
        chosen[key] = value
    return chosen, skipped


def write_deepspeed_env(
    path: str | Path, environ: Mapping[str, str] = os.environ, launcher: str = "pdsh"
) -> list[str]:
    """Write allow-listed variables as `KEY=VALUE` lines; returns the keys written.

    Lines of an existing file whose keys we do not set are kept (the user's own additions).
    """
    chosen, _ = deepspeed_env_vars(environ, launcher)
    p = Path(path)
    kept: list[str] = []
    if p.is_file():
        for line in p.read_text().splitlines():
            key = line.split("=", 1)[0].strip()
            if line.strip() and key not in chosen:
                kept.append(line)
    lines = kept + [f"{k}={v}" for k, v in chosen.items()]
    p.write_text("".join(f"{line}\n" for line in lines))
    return list(chosen)


# ---- CLI for launch.sh -------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.launch.hostfile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("world-size", help="print the number of ranks a launch will start")
    w.add_argument("--hostfile", help="hostfile (without it: localhost with --local-slots)")
    w.add_argument("--include", default=None, help="DeepSpeed --include spec, e.g. host1:0,1@host2")
    w.add_argument("--num-gpus", type=int, default=None, help="ranks per host (DeepSpeed --num_gpus)")
    w.add_argument(
        "--local-slots", type=int, default=None, help="slots of localhost when there is no hostfile"
    )
    h = sub.add_parser("hosts", help="validate a hostfile and print the hosts a launch uses, one per line")
    h.add_argument("--hostfile", required=True)
    h.add_argument("--include", default=None, help="keep only these hosts (DeepSpeed --include spec)")
    s = sub.add_parser("slurm-hostfile", help="write a hostfile from SLURM_JOB_NODELIST")
    s.add_argument("--nodelist", default=None, help="default: $SLURM_JOB_NODELIST")
    s.add_argument("--slots", type=int, default=None, help="default: $SLURM_GPUS_ON_NODE")
    s.add_argument("-o", "--output", default=None, help="file to write (stdout if omitted)")
    e = sub.add_parser("write-env", help="write .deepspeed_env from the allow-list")
    e.add_argument("--path", default=None, help="default: ./$DS_ENV_FILE or ./.deepspeed_env")
    e.add_argument("--launcher", default="pdsh", help="the multi-node backend that will read the file")
    args = parser.parse_args(argv)

    if args.cmd == "world-size":
        if args.hostfile:
            hosts = parse_hostfile(args.hostfile)
        elif args.local_slots is not None or args.num_gpus is not None:
            hosts = {"localhost": args.local_slots or 0}
        else:
            raise HostfileError("world-size needs --hostfile, --local-slots or --num-gpus")
        print(world_size(hosts, args.include, args.num_gpus))
    elif args.cmd == "hosts":
        print("\n".join(active_hosts(parse_hostfile(args.hostfile), args.include)))
    elif args.cmd == "slurm-hostfile":
        nodelist = args.nodelist if args.nodelist is not None else os.environ.get("SLURM_JOB_NODELIST", "")
        slots = args.slots if args.slots is not None else slurm_slots(os.environ)
        if slots is None or slots < 1:
            raise HostfileError("slots per node unknown: SLURM_GPUS_ON_NODE is unset; pass --slots N")
        text = format_hostfile(dict.fromkeys(slurm_hosts(nodelist), slots))
        if args.output:
            Path(args.output).write_text(text)
        else:
            sys.stdout.write(text)
    elif args.cmd == "write-env":
        path = Path(args.path) if args.path else deepspeed_env_path(os.environ)
        keys = write_deepspeed_env(path, os.environ, args.launcher)
        _, skipped = deepspeed_env_vars(os.environ, args.launcher)
        print(f"wrote {path}: {', '.join(keys) or '(no variables)'}", file=sys.stderr)
        if skipped:
            why = "characters DeepSpeed would quote" if args.launcher == "openmpi" else "shell characters"
            print(f"skipped ({why} in the value): {', '.join(skipped)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
