"""Fast cold load of a rank's shard from safetensors files into a CUDA arena.

Why not `safetensors.torch.load_file(device="cuda")` or per-tensor `copy_` from an mmap: both
move data in tensor-sized pieces from pageable memory, one at a time, so the disk, the page
cache copy and the PCIe link take turns instead of working together. Here the files are read
with large sequential `preadv` calls into pinned host buffers by several threads at once, and
each thread's buffers drain to the arena with asynchronous host-to-device copies on its own
stream while the next read is already running (double buffering). The page cache is used
per read: a range the page cache already holds fully is read through it (a memory copy,
tens of GB/s), any other range with O_DIRECT straight from the disk into the pinned buffer
(the kernel's readahead, which several threads reading one file at different offsets
defeat, is then out of the way; measured on the H200's virtual disk: 1.57 GB/s buffered
against 2.12 GB/s direct). `direct=True`/`False` force one way.

Tensors whose bytes in the arena equal their bytes in the file (no dtype conversion, not
split, or split along the outermost dimension) are copied straight from the read buffers.
The others (dtype conversion, splits along inner dimensions) are staged whole on the device
and converted there, on the same stream, so ordering needs no extra synchronisation.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .residency import resident

MiB = 1 << 20
# Bytes in flight set the virtual disk's rate (H200 VM, 16 GB, cold, in process: 16 x 16 MiB
# 1.72 GB/s, 16 x 32 MiB 1.77, 32 x 16 MiB 1.85, 32 x 8 MiB 1.56; warm, in the daemon: 16 x 16
# MiB 19.8 GB/s, 32 x 8 MiB 14.1): many threads with 16 MiB reads, each pinning 2 x chunk.
DEFAULT_THREADS = 32
# A power of two matches torch's pinned-memory size classes; 32 x 2 x 16 MiB = 1 GiB pinned.
DEFAULT_CHUNK = 16 * MiB
PAGE = 4096


@dataclass(frozen=True)
class Piece:
    """Bytes [file_offset, file_offset + nbytes) of a file go to `arena_offset`."""

    file_offset: int
    nbytes: int
    arena_offset: int


@dataclass
class Job:
    """One unit of work for a thread: a file range and what to do with it."""

    path: Path
    start: int
    end: int
    pieces: list[Piece] = field(default_factory=list)
    entry: Any = None  # a loader Entry that needs staging + conversion on the device


@dataclass
class LoadStats:
    nbytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0
    threads: int = 0
    chunk: int = 0
    direct: bool | str = "auto"
    staged_tensors: int = 0
    cached_bytes: int = 0  # read through the page cache (the range was resident)
    direct_bytes: int = 0  # read with O_DIRECT
    setup_seconds: float = 0.0  # slowest thread's set-up (pinned buffers, stream)
    read_seconds: float = 0.0  # file reads, summed over threads
    wait_seconds: float = 0.0  # waiting for a buffer's copies to drain, summed over threads

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "nbytes": self.nbytes,
            "read_bytes": self.read_bytes,
            "seconds": round(self.seconds, 4),
            "gb_per_s": round(self.gbps, 2),
            "threads": self.threads,
            "chunk_mib": self.chunk // MiB,
            "direct": self.direct,
            "staged_tensors": self.staged_tensors,
            "cached_bytes": self.cached_bytes,
            "direct_bytes": self.direct_bytes,
            "setup_seconds": round(self.setup_seconds, 4),
            "read_seconds_sum": round(self.read_seconds, 3),
            "wait_seconds_sum": round(self.wait_seconds, 3),
        }


def raw_range(entry: Any) -> tuple[int, int] | None:
    """(file offset, nbytes) when the entry's arena bytes are a plain byte range of the file."""
    src = entry.source
    if entry.dtype != src.dtype:
        return None
    spec = entry.spec
    if spec.dim is None:
        return src.offset, src.nbytes
    outer = 1
    for d in src.shape[: spec.dim]:
        outer *= d
    if outer != 1:
        return None
    inner = src.dtype.itemsize
    for d in src.shape[spec.dim + 1 :]:
        inner *= d
    return src.offset + spec.start * inner, spec.length * inner


def plan_jobs(entries: list[Any], chunk: int) -> list[Job]:
    """Split the layout into jobs of at most `chunk` bytes of contiguous file data each.

    Direct copies are grouped by file and file order, so reads stay sequential; each staged
    (converted) tensor is one job, read in chunks by one thread.
    """
    jobs: list[Job] = []
    by_file: dict[Path, list[Piece]] = {}
    for entry in entries:
        if entry.nbytes == 0:
            continue
        found = raw_range(entry)
        if found is None:
            src = entry.source
            jobs.append(Job(Path(src.file), src.offset, src.offset + src.nbytes, entry=entry))
            continue
        offset, nbytes = found
        by_file.setdefault(Path(entry.source.file), []).append(Piece(offset, nbytes, entry.offset))
    # Files in name order, each front to back: the order `prefetch` warms them in.
    for path, pieces in sorted(by_file.items()):
        pieces.sort(key=lambda p: p.file_offset)
        current: Job | None = None
        for piece in pieces:
            pos, left, dst = piece.file_offset, piece.nbytes, piece.arena_offset
            while left:
                if current is None or current.end != pos or current.end - current.start >= chunk:
                    current = Job(path, pos, pos)
                    jobs.append(current)
                take = min(left, chunk - (current.end - current.start))
                current.pieces.append(Piece(pos, take, dst))
                current.end += take
                pos, left, dst = pos + take, left - take, dst + take
    # Large jobs first (stable: file order kept among equals), so the tail is small ones.
    jobs.sort(key=lambda j: j.end - j.start, reverse=True)
    return jobs


class _Reader:
    """Per-thread state: open files, two pinned buffers, one stream."""

    def __init__(self, device: torch.device, chunk: int, direct: bool | str) -> None:
        t0 = time.perf_counter()
        self.chunk = chunk
        self.span = span_of(chunk)  # file bytes per read; alignment slack fits in `chunk`
        self.mode = direct  # True, False or "auto" (per range, by page-cache residency)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        # Pinned blocks are page-aligned already (and sized in powers of two: no slack there).
        slack = 0 if self.cuda else PAGE
        block = torch.empty(2 * chunk + slack, dtype=torch.uint8, pin_memory=self.cuda)
        at = -block.data_ptr() % PAGE  # O_DIRECT wants page-aligned memory
        self.buffers = [block[at : at + chunk], block[at + chunk : at + 2 * chunk]]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.fds: dict[tuple[Path, bool], int] = {}
        self.read_bytes = 0
        self.cached_bytes = 0
        self.direct_bytes = 0
        self.read_seconds = 0.0
        self.wait_seconds = 0.0
        self.setup_seconds = time.perf_counter() - t0

    def fd(self, path: Path, direct: bool) -> int:
        key = (path, direct)
        if key not in self.fds:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
            self.fds[key] = os.open(path, flags)
        return self.fds[key]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _use_direct(self, path: Path, start: int, end: int) -> bool:
        if self.mode is True or self.mode is False:
            return self.mode
        # auto: the page cache serves a resident range far faster than the disk could.
        return not resident(self.fd(path, False), start, end - start)

    def read(self, path: Path, start: int, end: int) -> tuple[torch.Tensor, int]:
        """Read [start, end) into the next free pinned buffer; (buffer, skip) where data starts."""
        slot = self.turn
        self.turn ^= 1
        event = self.events[slot]
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()  # the copies out of this buffer have finished
            self.wait_seconds += time.perf_counter() - t0
        buf = self.buffers[slot]
        t_read = time.perf_counter()
        direct = self._use_direct(path, start, end)
        lo = start - start % PAGE if direct else start
        hi = end + (-end) % PAGE if direct else end
        view = memoryview(buf.numpy())[: hi - lo]
        got = 0
        try:
            got = _read_fully(self.fd(path, direct), view, lo)
        except OSError:
            if not direct:
                raise
            # The file system refuses O_DIRECT (tmpfs, overlay): buffered reads from now on.
            self.mode = direct = False
            lo, hi = start, end
            view = memoryview(buf.numpy())[: hi - lo]
            got = _read_fully(self.fd(path, False), view, lo)
        if got < end - lo:
            raise OSError(f"{path}: short read at {lo}: {got} of {end - lo} bytes")
        self.read_seconds += time.perf_counter() - t_read
        self.read_bytes += got
        if direct:
            self.direct_bytes += got
        else:
            self.cached_bytes += got
        return buf, start - lo

    def on_stream(self) -> contextlib.AbstractContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def done(self, buf: torch.Tensor) -> None:
        if self.stream is None:
            return  # CPU copies are synchronous
        slot = 0 if buf is self.buffers[0] else 1
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[slot] = event


def span_of(chunk: int) -> int:
    """File bytes one read may cover so that its page-aligned extent fits in `chunk`."""
    return chunk - 2 * PAGE


def _read_fully(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    total = len(view)
    while got < total:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def copy_entry(raw: torch.Tensor, entry: Any, dst: torch.Tensor) -> None:
    """Fill `dst` (a loader `Entry`'s `nbytes` of the arena, uint8) from `raw` (the stored
    tensor's bytes, flat uint8, on any device).

    A tensor kept in its stored dtype is copied as bytes: a typed copy is not a byte copy (a
    BOOL byte that is neither 0 nor 1 would come out as 0x01), and the cache serves exactly
    what safetensors reads. The row split of a sharded tensor is a narrow over the same
    bytes, each element kept whole as its trailing `itemsize` bytes. Only a `--dtype`
    conversion goes through typed views.
    """
    src, spec = entry.source, entry.spec
    if entry.dtype == src.dtype:
        size = src.itemsize
        value = raw.view(*src.shape, size)
        if spec.dim is not None:
            value = value.narrow(spec.dim, spec.start, spec.length)
        dst.view(*spec.shape, size).copy_(value, non_blocking=True)
        return
    if raw.data_ptr() % src.itemsize:
        raw = raw.clone()  # unaligned in the file: view(dtype) needs aligned storage
    value = raw.view(src.dtype).view(src.shape)
    if spec.dim is not None:
        value = value.narrow(spec.dim, spec.start, spec.length)
    dst.view(entry.dtype).view(spec.shape).copy_(value, non_blocking=True)


def _run_job(reader: _Reader, job: Job, flat: torch.Tensor) -> None:
    if job.entry is None:
        buf, skip = reader.read(job.path, job.start, job.end)
        with reader.on_stream():
            for piece in job.pieces:
                at = skip + piece.file_offset - job.start
                dst = flat[piece.arena_offset : piece.arena_offset + piece.nbytes]
                dst.copy_(buf[at : at + piece.nbytes], non_blocking=True)
        reader.done(buf)
        return
    entry = job.entry
    src = entry.source
    with reader.on_stream():
        staged = torch.empty(src.nbytes, dtype=torch.uint8, device=flat.device)
    pos = job.start
    while pos < job.end:
        end = min(job.end, pos + reader.span)
        buf, skip = reader.read(job.path, pos, end)
        with reader.on_stream():
            staged[pos - job.start : end - job.start].copy_(
                buf[skip : skip + end - pos], non_blocking=True
            )
        reader.done(buf)
        pos = end
    with reader.on_stream():
        copy_entry(staged, entry, flat[entry.offset : entry.offset + entry.nbytes])
        del staged


def _job_nbytes(job: Job) -> int:
    """Arena bytes a job fills (what progress counts)."""
    if job.entry is not None:
        return int(job.entry.nbytes)
    return sum(p.nbytes for p in job.pieces)


def direct_mode(value: str | bool | None) -> bool | str:
    """`WEIGHTCACHE_LOAD_DIRECT`: auto (default), 1/true/yes (always), 0/false/no (never)."""
    if isinstance(value, bool):
        return value
    text = (value or "auto").strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    if text == "auto":
        return "auto"
    raise ValueError(f"WEIGHTCACHE_LOAD_DIRECT={value!r}: use auto, 1 or 0")


def load_entries(
    entries: list[Any],
    flat: torch.Tensor,
    *,
    threads: int | None = None,
    chunk: int | None = None,
    direct: bool | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> LoadStats:
    """Fill the arena `flat` (uint8, 1-D; CUDA, or CPU for tests) with loader `Entry` objects.

    Tuning comes from the arguments or `WEIGHTCACHE_LOAD_THREADS`, `WEIGHTCACHE_LOAD_CHUNK_MIB`
    and `WEIGHTCACHE_LOAD_DIRECT`; `progress(n)` is called (from the loader's threads) with
    the arena bytes of each finished read as they are queued to the device. Returns what was
    moved and how fast.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("the arena must be a flat uint8 tensor")
    threads = threads or int(os.environ.get("WEIGHTCACHE_LOAD_THREADS", DEFAULT_THREADS))
    chunk = chunk or int(os.environ.get("WEIGHTCACHE_LOAD_CHUNK_MIB", DEFAULT_CHUNK // MiB)) * MiB
    chunk = max(4 * PAGE, chunk - chunk % PAGE)
    mode = direct_mode(os.environ.get("WEIGHTCACHE_LOAD_DIRECT") if direct is None else direct)
    if not hasattr(os, "O_DIRECT"):
        mode = False
    stats = LoadStats(threads=threads, chunk=chunk, direct=mode)
    stats.nbytes = sum(e.nbytes for e in entries)
    jobs = plan_jobs(entries, span_of(chunk))
    stats.staged_tensors = sum(1 for j in jobs if j.entry is not None)
    t0 = time.perf_counter()
    work: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    for job in jobs:
        work.put(job)
    count = max(1, min(threads, len(jobs)))
    for _ in range(count):
        work.put(None)
    errors: list[BaseException] = []
    readers: list[_Reader] = []
    lock = threading.Lock()
    device = flat.device

    def worker() -> None:
        reader = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            reader = _Reader(device, chunk, mode)
            while True:
                job = work.get()
                if job is None or errors:
                    break
                _run_job(reader, job, flat)
                if progress is not None:
                    progress(_job_nbytes(job))
            if reader.stream is not None:
                reader.stream.synchronize()
        except BaseException as exc:
            errors.append(exc)
        finally:
            if reader is not None:
                with lock:
                    readers.append(reader)
                reader.close()

    pool = [threading.Thread(target=worker, name=f"coldload-{i}") for i in range(count)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - t0
    stats.read_bytes = sum(r.read_bytes for r in readers)
    stats.cached_bytes = sum(r.cached_bytes for r in readers)
    stats.direct_bytes = sum(r.direct_bytes for r in readers)
    stats.setup_seconds = max((r.setup_seconds for r in readers), default=0.0)
    stats.read_seconds = sum(r.read_seconds for r in readers)
    stats.wait_seconds = sum(r.wait_seconds for r in readers)
    if errors:
        raise errors[0]
    return stats


def load_layout(layout: Any, flat: torch.Tensor, **kwargs: Any) -> LoadStats:
    """Entry point for the daemon's loader (`loader.load_into_arena` on CUDA)."""
    return load_entries(list(layout.entries), flat, **kwargs)


def drop_page_cache(paths: list[Path | str]) -> bool:
    """Evict the files from the page cache; True when the global drop also worked.

    `posix_fadvise(DONTNEED)` works for any user on clean pages of these files; writing
    /proc/sys/vm/drop_caches (root only) drops everything else as well.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False
