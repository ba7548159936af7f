"""Network helpers shared by the multi-process tests."""

import itertools
import os
import random
import socket

# Why not the kernel's own free port (bind to 0): that comes from the ephemeral range, which every outgoing TCP
# connection also draws from (gloo opens many between CPU ranks), so in the seconds between choosing the port and the
# launcher binding it, another xdist worker's connection could take it (EADDRINUSE, seen once in CI). Ports below
# the ephemeral range are never handed out that way, and each xdist worker draws from its own block of them.
_BLOCK = 1500


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    low = max(1024, min(_ephemeral_low(), 60000) - 8 * _BLOCK) + (index % 8) * _BLOCK
    return range(low, low + _BLOCK)


_cursor = itertools.count(random.randrange(_BLOCK))


def free_port(span: int = 1) -> int:
    """A port (and the `span - 1` after it) free right now, outside the kernel's ephemeral range and in this xdist
    worker's own block, so concurrent launcher tests never share a rendezvous port."""
    block = _worker_block()
    for _ in range(len(block)):
        port = block.start + next(_cursor) % (len(block) - span + 1)
        if all(_bindable(port + k) for k in range(span)):
            return port
    raise RuntimeError(f"no {span} free ports in {block}")
