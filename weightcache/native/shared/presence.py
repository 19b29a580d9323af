"""Is a daemon loading, or is there none? Told from the socket's lock file, without touching it.

A daemon takes `<socket>.lock` (an exclusive `flock`) before it loads and binds the socket only
once the whole shard is loaded (`daemon.py`). So "no socket, lock held" means a daemon is
loading, and "no socket, no lock (or a stale one)" means none is there. The client must not
try the lock itself: a probe holding it for an instant could make a starting daemon believe
another one serves and exit. Instead the kernel's lock table (`/proc/locks`, see proc(5):
one line per lock, `FLOCK ... <pid> <major>:<minor>:<inode>`) is read and matched by the
lock file's device and inode.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_LOCKS = Path("/proc/locks")


def lock_path(socket_path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(socket_path)}.lock")


def _holders(st: os.stat_result, table: str) -> list[str]:
    """PIDs (as listed) holding a flock on the file `st` describes."""
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    found = []
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" not in fields or "->" in fields:  # "->" marks a waiter, not a holder
            continue
        at = fields.index("FLOCK")
        if len(fields) < at + 5:
            continue
        pid, ident = fields[at + 3], fields[at + 4]
        parts = ident.split(":")
        if len(parts) != 3:
            continue
        try:
            dev_major, dev_minor, inode = int(parts[0], 16), int(parts[1], 16), int(parts[2])
        except ValueError:
            continue
        if (dev_major, dev_minor, inode) == (major, minor, st.st_ino):
            found.append(pid)
    return found


def loading_daemon(socket_path: str | os.PathLike) -> str | None:
    """A description of the daemon that holds the lock but has not bound yet, else None."""
    lock = lock_path(socket_path)
    try:
        st = os.stat(lock, follow_symlinks=False)
    except OSError:
        return None
    try:
        holders = _holders(st, PROC_LOCKS.read_text())
    except OSError:
        return None
    if not holders:
        return None  # a stale lock file of a daemon that was killed outright
    pid = ""
    try:
        with open(lock, "rb") as f:
            pid = f.read(32).decode(errors="replace").strip()
    except OSError:
        pass
    return f"pid {pid or holders[0]}"
