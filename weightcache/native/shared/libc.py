"""The C library through ctypes, loaded once (torch-free). A ctypes call releases the GIL, so
the syscalls our threads make (`madvise`, `mincore`, `cachestat`) run side by side.

The library is the one the interpreter itself is linked with, found in the process's own
symbols (`dlopen(NULL)`). Not `ctypes.util.find_library("c")`: that runs `/sbin/ldconfig -p`
in a child process at import, in every rank and every engine that imports this module; with
every cache dropped that child faults its binary in from the disk, and its faults, not the
rank's own, made a loading rank yield the disk to itself (diskshare.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

try:
    LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - no dynamic loader (not Linux)
    LIBC = None


def function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any | None:
    """A function of the C library with its own signature (each caller gets its own pointer
    object, so one module's argtypes never change another's); None where it is missing."""
    if LIBC is None:
        return None
    try:
        fn = LIBC[name]
    except AttributeError:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


PR_SET_PDEATHSIG = 1  # prctl(2)
_prctl = function("prctl", [ctypes.c_int, ctypes.c_ulong])


def request_parent_death_signal(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Ask for `sig` when the parent dies; False if `parent_pid` is already gone.

    The parent may die between our start and the request, in which case no signal will
    come: the caller must stop by itself when this returns False. (The signal follows the
    parent *thread* that started this process.)
    """
    if _prctl is not None:  # not Linux: nothing to ask for
        _prctl(PR_SET_PDEATHSIG, sig)
    return os.getppid() == parent_pid
