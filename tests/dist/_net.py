"""Network helpers shared by the multi-process tests."""

import socket


def free_port() -> int:
    """A port free right now, so concurrent launcher tests never share a rendezvous port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
