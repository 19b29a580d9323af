"""Large host buffers made ready fast: huge pages, populated by several threads (torch-free).

An update stages the arena's size in host memory (16 GB for an 8B-shaped rank), and pins it
for the paused copy. A fresh allocation is populated by its first touch, one 4 KiB fault at a
time on one thread, and `cudaHostRegister` of an untouched range does exactly that inside the
driver, single-threaded: seconds for 16 GB, in front of the read. Here the range asks for
transparent huge pages (`MADV_HUGEPAGE`: 512x fewer faults where the kernel allows them) and
is populated with `MADV_POPULATE_WRITE` (Linux 5.14) in slices, one per thread: each call
releases the GIL (ctypes), and the kernel's per-VMA locks let the faults run side by side.
Where the kernel lacks either advice the mapping is still correct, only slower to fill.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from . import libc

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
SLICE_BYTES = 1 << 30  # a thread's unit of population (huge-page aligned)

_madvise = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def address(buf: mmap.mmap) -> int:
    """The first byte's address (the mapping stays closable: no export is kept)."""
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _populate(addr: int, length: int) -> bool:
    assert _madvise is not None
    return _madvise(addr, length, MADV_POPULATE_WRITE) == 0


def populated(nbytes: int, threads: int | None = None) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (> 0), huge pages advised, its pages in place.

    Returns the mapping even where population is refused (an older kernel): the pages then
    come on first touch, as they would have anyway."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: 4 KiB pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    if _madvise is None:
        return buf
    base = address(buf)
    slices = [(at, min(SLICE_BYTES, nbytes - at)) for at in range(0, nbytes, SLICE_BYTES)]
    if not _populate(base, slices[0][1]):
        return buf  # EINVAL before 5.14 (or no memory now): first touch does it
    rest = slices[1:]
    if not rest:
        return buf
    count = max(1, min(threads or os.cpu_count() or 1, len(rest)))
    failed = threading.Event()  # no memory left: the rest comes on first touch, if at all

    def work(piece: tuple[int, int]) -> None:
        if not failed.is_set() and not _populate(base + piece[0], piece[1]):
            failed.set()

    with ThreadPoolExecutor(count, thread_name_prefix="weightcache-populate") as pool:
        list(pool.map(work, rest))
    return buf
