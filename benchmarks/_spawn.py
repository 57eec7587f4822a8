"""Benchmarks start their gloo ranks with the library's one launcher helper; the launcher
benchmarks (elastic, goodput) find a free rendezvous port and wait for it with these two."""

import socket

from hybridpar.distributed.spawn import run_ranks

__all__ = ["free_port", "listening", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a c10d rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` (the rendezvous is up)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
