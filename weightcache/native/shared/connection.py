"""A checked connection to a daemon socket, and requests over it, for every client of a daemon.

Every connection the product makes to a daemon goes through `connect`: the engine's attach,
the update participant, `weightcache update` (the coordinator), the launcher's liveness
ping and the node agent's probes (native and vLLM daemons). Each checks the socket's
directory and file and, once connected, the daemon's uid (SO_PEERCRED) the same way, so a
listener another user put behind the path is never believed; every failure is a
`WeightCacheError` (`errors.py`). Torch-free, so the node agent and `weightcache update` use it
without torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import protocol as proto
from .errors import (
    CacheProtocolError,
    CacheSecurityError,
    DaemonError,
    DaemonLoadingError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    FingerprintMismatchError,
    NotReadyError,
    ReleasedError,
)
from .presence import loading_daemon
from .security import SecurityError, check_peer, check_socket_path, trusted_uids


def connect(path: str | os.PathLike, *, timeout: float = 5.0) -> socket.socket:
    """Connect to a daemon socket after checking its directory and file and, once connected,
    the peer uid (ours or one of WEIGHTCACHE_DAEMON_UID)."""
    path = Path(path)
    try:
        owners = trusted_uids()
        check_socket_path(path, owners)
    except FileNotFoundError:
        loading = loading_daemon(path)
        if loading:
            raise DaemonLoadingError(
                f"no daemon socket at {path} yet: a daemon is loading ({loading} holds"
                f" {path}.lock); it binds the socket once the shard is loaded, retry then"
            ) from None
        raise DaemonUnavailableError(f"no daemon socket at {path}") from None
    except SecurityError as exc:
        raise CacheSecurityError(str(exc)) from None
    except OSError as exc:
        raise DaemonUnavailableError(f"cannot check {path}: {exc}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        _connect_within(sock, str(path), timeout)
        check_peer(sock, owners)
    except SecurityError as exc:
        sock.close()
        raise CacheSecurityError(f"daemon at {path}: {exc}") from None
    except OSError as exc:
        sock.close()
        raise DaemonUnavailableError(f"cannot connect to {path}: {exc}") from None
    return sock


def _connect_within(sock: socket.socket, path: str, timeout: float) -> None:
    """connect(), retrying while the listen backlog is full (EAGAIN on a Unix socket) until
    `timeout`: a burst of engines then waits for the daemon instead of falling back."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def request(
    sock: socket.socket, cmd: str, *, accept_fds: bool = False, max_frame: int = proto.MAX_FRAME,
    deadline: float | None = None, **fields: Any
) -> tuple[dict[str, Any], list[int]]:
    """One request and its reply; `deadline` (monotonic) bounds the whole reply, not each read."""
    send_request(sock, cmd, **fields)
    return recv_reply(sock, cmd, accept_fds=accept_fds, max_frame=max_frame, deadline=deadline)


@contextlib.contextmanager
def _daemon_errors(cmd: str, late: str) -> Iterator[None]:
    """A socket's failures as the client's errors; `late`: what the daemon did not do in time."""
    try:
        yield
    except TimeoutError:
        raise DaemonTimeoutError(f"daemon did not {late} {cmd!r} in time") from None
    except proto.ProtocolError as exc:
        raise CacheProtocolError(f"{cmd}: {exc}") from None
    except OSError as exc:
        raise DaemonUnavailableError(f"{cmd}: {exc}") from None


def send_request(sock: socket.socket, cmd: str, **fields: Any) -> None:
    """The first half of `request`: the caller may work while the daemon answers."""
    with _daemon_errors(cmd, "take"):
        proto.send_frame(sock, {"cmd": cmd, **fields})


def recv_reply(
    sock: socket.socket, cmd: str, *, accept_fds: bool = False, max_frame: int = proto.MAX_FRAME,
    deadline: float | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """The second half of `request`: the reply to `cmd`."""
    with _daemon_errors(cmd, "answer"):
        return proto.recv_frame(sock, accept_fds=accept_fds, max_frame=max_frame,
                                deadline=deadline)


PROBE_FRAME = 1 << 20  # a probe's reply (hello, get_memory, stats) is small


def query(path: str | os.PathLike, cmd: str, *, timeout: float = 2.0, **fields: Any) -> dict:
    """One request/reply without fds (hello, get_memory, stats) within `timeout` in all: for
    probes (the launcher's liveness, the node agent)."""
    deadline = time.monotonic() + timeout
    with contextlib.closing(connect(path, timeout=timeout)) as sock:
        reply, _ = request(sock, cmd, max_frame=PROBE_FRAME, deadline=deadline, **fields)
        return reply


def raise_for(reply: dict[str, Any]) -> None:
    """Raise the WeightCacheError an error reply stands for (nothing for an ok reply)."""
    if reply.get("ok"):
        return
    code = str(reply.get("error", "error"))
    message = str(reply.get("message", code))
    if code == proto.E_FINGERPRINT_MISMATCH:
        fields = [str(f) for f in reply.get("fields", []) if isinstance(f, str)]
        raise FingerprintMismatchError(message, fields)
    if code == proto.E_RELEASED:
        raise ReleasedError(message)
    if code == proto.E_NOT_READY:
        raise NotReadyError(message)
    if code == proto.E_PERMISSION_DENIED:
        raise CacheSecurityError(message)
    raise DaemonError(message, code)
