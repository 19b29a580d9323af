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
import errno
import mmap
from concurrent.futures import ThreadPoolExecutor

from . import cgroups, libc

MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14
MADV_POPULATE_WRITE = 23
SLICE_BYTES = 1 << 30  # a thread's unit of population (huge-page aligned)
# Host memory a large buffer of ours must leave free (so that it never pushes the node into OOM).
RESERVE_BYTES = 512 << 20

_madvise = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def address(buf: mmap.mmap) -> int:
    """The first byte's address (the mapping stays closable: no export is kept)."""
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def populate(addr: int, length: int, advice: int = MADV_POPULATE_WRITE,
             threads: int | None = None) -> int:
    """Fault `length` bytes at `addr` in with `advice` (MADV_POPULATE_WRITE for fresh memory,
    MADV_POPULATE_READ for a file mapping), a slice per thread: 0, or the first slice's errno.

    The first slice runs here alone: on a kernel without the advice (EINVAL before 5.14) no
    thread is started. After a failure the remaining slices are skipped."""
    if _madvise is None:
        return errno.ENOSYS
    slices = [(at, min(SLICE_BYTES, length - at)) for at in range(0, length, SLICE_BYTES)]
    if not slices:
        return 0
    if _madvise(addr, slices[0][1], advice) != 0:
        return ctypes.get_errno()
    rest = slices[1:]
    if not rest:
        return 0
    failed: list[int] = []  # the first errno; then the rest is skipped

    def work(piece: tuple[int, int]) -> None:
        if not failed and _madvise(addr + piece[0], piece[1], advice) != 0:
            failed.append(ctypes.get_errno())

    count = max(1, min(threads or cgroups.usable_cpus(), len(rest)))
    with ThreadPoolExecutor(count, thread_name_prefix="weightcache-populate") as pool:
        list(pool.map(work, rest))
    return failed[0] if failed else 0


def populated(nbytes: int, threads: int | None = None) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (> 0), huge pages advised, its pages in place.

    Returns the mapping even where population is refused (an older kernel, or no memory now):
    the pages then come on first touch, as they would have anyway."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: 4 KiB pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    populate(address(buf), nbytes, MADV_POPULATE_WRITE, threads)
    return buf
