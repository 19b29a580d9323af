"""Large host buffers populated by several threads (hostmem.py): the pages are in place
before anyone touches them, and the buffer reads as zeros and takes writes."""

from __future__ import annotations

import ctypes
import mmap

from weightcache.native.shared import hostmem, libc

PAGE = mmap.PAGESIZE


def test_every_slice_is_populated_by_the_threads_and_reads_as_zeros(monkeypatch):
    monkeypatch.setattr(hostmem, "SLICE_BYTES", 1 << 20)  # 9 slices: the first here, 8 on threads
    nbytes = 9 * (1 << 20) - PAGE
    buf = hostmem.populated(nbytes, threads=3)
    assert len(buf) == nbytes
    mincore = libc.function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    pages = (nbytes + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert mincore(hostmem.address(buf), nbytes, vec) == 0
    assert all(v & 1 for v in vec), "a page was left for first touch"
    assert buf[:] == bytes(nbytes)
    buf[nbytes - 1] = 7
    assert buf[nbytes - 1] == 7
    buf.close()
