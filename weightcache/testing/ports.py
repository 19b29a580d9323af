"""Loopback ports for the processes that tests and benchmarks start.

A port is picked here and bound later by another process (an agent, an operator, a webhook
server), so in between it must not be handed to anything else. The kernel's own pick (bind to
port 0) comes from the ephemeral range, the same range every outgoing connection's source port
comes from: on a busy test machine a client socket of another test took such a port before the
agent bound it, and the agent exited as it should on a port it cannot bind. So ports come from
below the ephemeral range, which the kernel never hands out by itself, and each pytest-xdist
worker takes its own slice of them, from a random start and then in turn, so two workers (or a
worker and the benchmark processes it starts) do not probe the same port at the same moment.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

# Below this sit well-known and commonly configured service ports (and nothing of ours).
LOWEST = 10000
# The Linux default, where /proc cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
# pytest-xdist workers get equal slices of the pool; more workers share slices.
SLICES = 16

_lock = threading.Lock()
_turn: tuple[Iterator[int], int] | None = None  # this process's ports in turn, and how many


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for ports it picks itself (port 0 binds and client sockets)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def pool(worker: str | None = None, ephemeral: tuple[int, int] | None = None) -> range:
    """The ports this process hands out: its xdist worker's slice of those below the range."""
    low, _ = ephemeral or ephemeral_range()
    ports = range(LOWEST, low)
    if len(ports) < SLICES * 64:
        return range(0)
    size = len(ports) // SLICES
    index = int(worker[2:]) % SLICES if worker and worker[2:].isdigit() else SLICES - 1
    return range(ports.start + index * size, ports.start + (index + 1) * size)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_pick() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and the kernel will not hand out.

    Falls back to the kernel's pick only where the ephemeral range leaves no room below it.
    """
    global _turn
    with _lock:
        if _turn is None:
            ports = pool(os.environ.get("PYTEST_XDIST_WORKER"))
            start = random.SystemRandom().randrange(len(ports)) if ports else 0
            _turn = itertools.cycle([*ports[start:], *ports[:start]]), len(ports)
        turn, count = _turn
        for port in itertools.islice(turn, count):
            if _bindable(port):
                return port
    return _kernel_pick()
