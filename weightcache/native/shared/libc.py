"""The C library through ctypes, loaded once (torch-free). A ctypes call releases the GIL, so
the syscalls our threads make (`madvise`, `mincore`, `cachestat`) run side by side."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

try:
    LIBC: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
except OSError:  # pragma: no cover - no libc (not Linux)
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
