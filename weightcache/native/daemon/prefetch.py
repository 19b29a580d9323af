"""Warm the page cache with the checkpoint while the daemon is still starting (torch-free).

A daemon spends seconds before it can read a single tensor into GPU memory: importing torch,
creating the CUDA context, allocating the arena. The disk is idle all that time. `Prefetcher`
reads the checkpoint files, in the order the cold loader will want them (files in name order,
each front to back), into the page cache from a few threads during that window and stops the
moment the loader starts. The loader then finds the first part resident and copies it at
memory speed (`coldload`'s per-range choice), reading only the rest from the disk, so the
start-up costs overlap with the disk instead of adding to it.

Ranges already resident are skipped without reading. Reads go into a small buffer per thread
and are thrown away; only the page cache keeps them (the kernel may evict them again under
memory pressure, which costs speed, never correctness).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from ..shared.residency import resident

MiB = 1 << 20
DEFAULT_THREADS = 8
DEFAULT_CHUNK = 8 * MiB


class Prefetcher:
    def __init__(
        self,
        files: list[Path | str],
        *,
        threads: int = DEFAULT_THREADS,
        chunk: int = DEFAULT_CHUNK,
        limit_bytes: int | None = None,
    ) -> None:
        self.chunk = chunk
        self.threads = max(1, threads)
        pieces: list[tuple[Path, int, int]] = []
        budget = limit_bytes if limit_bytes is not None else float("inf")
        for f in sorted(Path(p) for p in files):
            size = f.stat().st_size
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                if budget < n:
                    break
                budget -= n
                pieces.append((f, off, n))
        self._pieces = pieces
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool: list[threading.Thread] = []
        self.read_bytes = 0
        self.skipped_bytes = 0
        self.started = 0.0
        self.seconds = 0.0

    def start(self) -> Prefetcher:
        self.started = time.perf_counter()
        self._pool = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(min(self.threads, len(self._pieces)))
        ]
        for t in self._pool:
            t.start()
        return self

    def _take(self) -> tuple[Path, int, int] | None:
        with self._lock:
            if self._stop.is_set() or self._next >= len(self._pieces):
                return None
            piece = self._pieces[self._next]
            self._next += 1
            return piece

    def _work(self) -> None:
        buf = bytearray(self.chunk)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        try:
            while (piece := self._take()) is not None:
                path, off, n = piece
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                if resident(fd, off, n):
                    with self._lock:
                        self.skipped_bytes += n
                    continue
                got = os.preadv(fd, [view[:n]], off)
                with self._lock:
                    self.read_bytes += got
        except OSError:
            return  # prefetching is an optimisation: the loader reports real read errors
        finally:
            for fd in fds.values():
                os.close(fd)

    def stop(self) -> dict[str, Any]:
        """Stop after the reads in flight; what was read (bytes, seconds). Idempotent: the
        seconds are taken at the first stop, so a second call reports the same figures."""
        first = not self._stop.is_set()
        self._stop.set()
        for t in self._pool:
            t.join()
        if self.started and first:
            self.seconds = time.perf_counter() - self.started
        return {"read_bytes": self.read_bytes, "skipped_bytes": self.skipped_bytes,
                "seconds": round(self.seconds, 3)}
