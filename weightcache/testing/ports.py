"""Loopback ports for the processes that tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The kernel picks it and the probe socket is closed again, so the port is free for the
    process the caller starts next (a port picked this way can in principle be taken in
    between; on a test machine's loopback that does not happen in practice).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
