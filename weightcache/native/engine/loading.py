"""Waiting for a daemon that is still loading this engine's rank.

On a node new to the model the webhook lets an engine be scheduled while the cache loads (node
label `loading`), so the engine's interpreter, imports and CUDA context overlap the daemon's
load. When the engine reaches its weights the daemon may not have bound its socket yet: reading
the checkpoint from disk then would compete with the daemon for the same disk and finish later
than the daemon does. So the client waits, bounded by `WEIGHTCACHE_LOADING_WAIT_S` (default
`DEFAULT_WAIT_S`; 0 turns waiting off), and attaches the moment the socket appears.

The signal is the one `connect` already trusts for "loading": the socket's lock file is held
(`shared.presence.loading_daemon`, read from the kernel's lock table, never by taking the lock).
Waiting decides nothing about trust: once the socket exists, `connect` runs every check it
always runs (the socket file, the directory, the peer's credentials), so a process that fakes
a lock can at most make an engine wait out the bound and then load from disk, never attach to
it. The wait stops early when the lock's holder is gone (the daemon died: load from disk).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from weightcache import constants

from ..shared.presence import loading_daemon

DEFAULT_WAIT_S = 600.0  # a cold 70B rank from a slow disk; the engine would read it slower
POLL_S = 0.02


def wait_bound(explicit: float | None = None) -> float:
    if explicit is not None:
        return max(0.0, explicit)
    value = os.environ.get(constants.ENV_LOADING_WAIT)
    if value is None or value.strip() == "":
        return DEFAULT_WAIT_S
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"{constants.ENV_LOADING_WAIT}={value!r} is not a number") from None


def _bound(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def wait_while_loading(path: str | os.PathLike, bound_s: float,
                       poll_s: float = POLL_S) -> tuple[bool, float]:
    """(the socket is there now, seconds waited): waits while a daemon holds `path`'s lock."""
    path = Path(path)
    started = time.monotonic()
    deadline = started + bound_s
    while True:
        if _bound(path):
            return True, time.monotonic() - started
        if loading_daemon(path) is None:
            # The holder may have bound and released the lock in between: look once more.
            return _bound(path), time.monotonic() - started
        if time.monotonic() >= deadline:
            return False, time.monotonic() - started
        time.sleep(poll_s)
