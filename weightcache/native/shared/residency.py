"""How much of a file range the page cache holds, without reading it (torch-free).

The cold loader reads a range through the page cache when the cache already holds all of it
(a memory copy) and with O_DIRECT otherwise (the disk's full rate, no readahead fighting
between threads); the early reads leave ranges that are already resident to the fill. Both need the
answer without touching the data: `cachestat(2)` (Linux 6.5+) gives it for a byte range in
one call; older kernels get `mincore(2)` on a read-only mapping of the range, which maps no
page in. Where neither works the answer is "not resident", which only costs speed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform

from . import libc

PAGE = mmap.PAGESIZE
# cachestat is 451 in the generic syscall table and on x86-64 alike (Linux 6.5).
_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451, "arm64": 451}.get(platform.machine())


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


_libc = libc.LIBC
_use_cachestat = _libc is not None and _CACHESTAT_NR is not None and hasattr(_libc, "syscall")


def _pages(offset: int, length: int) -> tuple[int, int]:
    first = offset // PAGE
    last = (offset + length + PAGE - 1) // PAGE
    return first, last - first


def _cachestat(fd: int, offset: int, length: int) -> int | None:
    """Resident pages of the range, or None when the kernel lacks cachestat."""
    global _use_cachestat
    assert _libc is not None
    first, count = _pages(offset, length)
    rng = _Range(first * PAGE, count * PAGE)
    out = _Stat()
    rc = _libc.syscall(_CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(out), 0)
    if rc != 0:
        if ctypes.get_errno() in (38, 1):  # ENOSYS, EPERM (seccomp): never ask again
            _use_cachestat = False
        return None
    return int(out.nr_cache)


def _mincore(fd: int, offset: int, length: int) -> int | None:
    """Resident pages through mincore(2) on a PROT_READ mapping (no page is faulted in)."""
    if _libc is None:
        return None
    size = os.fstat(fd).st_size
    first, count = _pages(offset, min(length, max(0, size - offset)))
    if count == 0:
        return 0
    mm, mu = _libc.mmap, _libc.munmap
    mm.restype = ctypes.c_void_p
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_long]
    mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = mm(None, count * PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * PAGE)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = (ctypes.c_ubyte * count)()
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(count * PAGE), vec) != 0:
            return None
        return sum(v & 1 for v in vec)
    finally:
        mu(ctypes.c_void_p(addr), count * PAGE)


def resident_pages(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """(resident pages, pages) of the file range, or None when the kernel cannot say."""
    if length <= 0:
        return 0, 0
    _, count = _pages(offset, length)
    found = _cachestat(fd, offset, length) if _use_cachestat else None
    if found is None:
        found = _mincore(fd, offset, length)
    return None if found is None else (min(found, count), count)


def resident(fd: int, offset: int, length: int) -> bool:
    """True when every page of the file range is in the page cache."""
    answer = resident_pages(fd, offset, length)
    if answer is None:
        return False
    found, count = answer
    return found >= count
