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

One pass for the content digest: with `digest=files`, every byte of those files is read once,
in jobs cut on the content chunk grid (`content.CHUNK_BYTES`), and the reader thread hashes
each chunk from the buffer it just filled, while the buffer's copies to the device run. No
second reader, so O_DIRECT stays available and nothing is read twice. The files are opened
once up front and every thread reads that same inode (`/proc/self/fd`), and their identity is
checked again after the last read: a file replaced, rewritten or truncated during the load
raises ContentError naming it (never a record of bytes the arena does not hold, and never a
SIGBUS: nothing here maps a file).

Jobs that `earlyread.EarlyReads` read while the rank was still importing torch are taken from
its host memory instead of the disk (and hashed here like any other), when the files opened
here are the very files it read (same identity).

The same code fills a CPU arena (a memfd, or staging for an update): the buffers are then
ordinary page-aligned memory and the copies synchronous.
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

import numpy as np
import torch

from . import cgroups, loadenv, tpshare
from .content import CHUNK_BYTES, ChunkSink, ContentError, FileIdentity
from .diskshare import DiskShare, for_load, idle_io_priority
from .earlyread import (
    MAX_OPEN_PER_THREAD,
    PAGE,
    EarlyReads,
    cover_spans,
    grid_span,
    read_fully,
    share_spans,
    span_of,
)
from .residency import resident
from .threads import Pool

MiB = 1 << 20
# Bytes in flight set the virtual disk's rate (H200 VM, 16 GB, cold, in process: 16 x 16 MiB
# 1.72 GB/s, 16 x 32 MiB 1.77, 32 x 16 MiB 1.85, 32 x 8 MiB 1.56; warm, in the daemon: 16 x 16
# MiB 19.8 GB/s, 32 x 8 MiB 14.1): many threads with 16 MiB reads, each pinning 2 x chunk.
DEFAULT_THREADS = 32
# The read size (loadenv.DEFAULT_CHUNK, 16 MiB): a power of two matches torch's pinned-memory size
# classes; 32 x 2 x 16 MiB = 1 GiB pinned. MAX_OPEN_PER_THREAD: descriptors a reader keeps open.
# Page-cache reads and early-read copies are hashed in pieces this size, each while the CPU's cache
# still holds it (`WEIGHTCACHE_LOAD_HOT_STEP_MIB` sets another). HOT_STEP is four content chunks:
# 1 MiB when it was written (chunks were 256 KiB), 4 MiB since chunks are 1 MiB. Which piece is
# fastest depends on how many readers take turns at the GIL. Measured warm into a GPU with 16
# readers on an H100 VM (Xeon, 300 MiB of L3): 1 MiB pieces ran half as fast as 4 MiB (10.2-10.6
# against 19.3-20.0 GB/s: four times the `pread` calls and their turns at the GIL), 16 MiB 11-14%
# faster than 4 (22.6 / 23.8 against 19.8 / 21.4), 8 MiB +3%; on the 2-core development machine
# (AMD, 32 MiB of L3; 2 readers, so few turns) 16 MiB ran 10-12% slower than 4 (the piece no longer
# in the cache when its hash reads it) and 1 MiB the same (docs/results/cpu-2026-12-06-hotstep). So
# a fill with WIDE_SLOTS or more CPU slots hashes in HOT_STEP_WIDE pieces, a smaller one in HOT_STEP
# (`hot_step`); the threshold lies between the two machines measured. `weightcache bench load`'s
# `hotstep` part measures READY with 16 and 4 MiB in turn.
HOT_STEP = 4 * CHUNK_BYTES
HOT_STEP_WIDE = 16 * CHUNK_BYTES
WIDE_SLOTS = 8
# The CPU's work (page-cache copies, early-read copies, hashing) runs in at most this many
# readers at once: the disk wants 32 reads in flight, the CPU no more workers than cores (on
# the H200 host, 32 readers copying and hashing from the page cache ran 14.2 GB/s, 16 ran
# 21.8: tests/gpu/probe_io.py).
def cpu_slots(threads: int) -> int:
    return max(1, min(threads, cgroups.usable_cpus()))


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
    digest: bool = False  # [start, end) lies on the content chunk grid: hash it


@dataclass
class LoadStats:
    nbytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0
    threads: int = 0
    chunk: int = 0
    direct: bool | str = "auto"
    hot_step: int = HOT_STEP  # the piece a page-cache read is hashed in
    staged_tensors: int = 0
    cached_bytes: int = 0  # read through the page cache (the range was resident)
    direct_bytes: int = 0  # read with O_DIRECT
    hash_seconds: float = 0.0  # content digest in the reader threads, summed over threads
    record: dict[str, Any] | None = None  # name -> content.FileDigest, with digest=files
    setup_seconds: float = 0.0  # slowest thread's set-up (pinned buffers, stream)
    ready_seconds: float = 0.0  # from the fill's start until its last reader was set up
    early_bytes: int = 0  # taken from the reads made while the rank started (earlyread)
    read_seconds: float = 0.0  # file reads, summed over threads
    wait_seconds: float = 0.0  # waiting for a buffer's copies to drain, summed over threads
    disk: dict[str, Any] | None = None  # the disk's share (diskshare.DiskShare.stats)

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
            "hot_step_mib": self.hot_step // MiB,
            "staged_tensors": self.staged_tensors,
            "cached_bytes": self.cached_bytes,
            "direct_bytes": self.direct_bytes,
            "setup_seconds": round(self.setup_seconds, 4),
            "ready_seconds": round(self.ready_seconds, 4),
            "read_seconds_sum": round(self.read_seconds, 3),
            "wait_seconds_sum": round(self.wait_seconds, 3),
            "hash_seconds_sum": round(self.hash_seconds, 3),
            "early_bytes": self.early_bytes,
            "disk": self.disk,
        }


def raw_range(entry: Any) -> tuple[int, int] | None:
    """(file offset, nbytes) when the entry's arena bytes are a plain byte range of the file
    (`tpshare.byte_range`, the rule the early reads of a tensor-parallel rank apply too)."""
    src = entry.source
    return tpshare.byte_range(src.offset, src.nbytes, src.shape, src.itemsize,
                              entry.spec, entry.dtype != src.dtype)


def read_ranges(entries: list[Any]) -> dict[Path, list[tuple[int, int]]]:
    """File byte ranges (offset, nbytes) the entries' bytes come from, per file."""
    out: dict[Path, list[tuple[int, int]]] = {}
    for entry in entries:
        if entry.nbytes == 0:
            continue
        found = raw_range(entry) or (entry.source.offset, entry.source.nbytes)
        out.setdefault(Path(entry.source.file), []).append(found)
    return out


def share_chunks(entries: list[Any]) -> dict[Path, set[int]]:
    """The content chunks a rank's entries read, per file: what a tensor-parallel rank
    digests, and where its engines' claims sample (the same function on both sides)."""
    out: dict[Path, set[int]] = {}
    for path, ranges in read_ranges(entries).items():
        chunks = out.setdefault(path, set())
        for offset, nbytes in ranges:
            chunks.update(tpshare.chunks(offset, nbytes))
    return out


def plan_jobs(entries: list[Any], chunk: int, cover: dict[Path, int] | None = None,
              share: dict[Path, set[int]] | None = None,
              own: dict[Path, set[int]] | None = None) -> list[Job]:
    """Split the layout into jobs of at most `chunk` bytes of contiguous file data each.

    Direct copies are grouped by file and file order, so reads stay sequential; each staged
    (converted) tensor is one job, read in chunks by one thread. Files in `cover` (path ->
    size) are read whole, in jobs that start and end on the content chunk grid (`_cover`);
    with `share`, only those chunks of them, cut apart where `own` begins or ends (the chunks
    no other tensor-parallel rank reads: the early reads take those jobs, earlyread.py).
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
    for path, size in sorted((cover or {}).items()):
        chunks = None if share is None else share.get(path, set())
        mine = None if own is None else own.get(path, set())
        jobs.extend(_cover(path, size, by_file.pop(path, []), chunk, chunks, mine))
    # Files in name order, each front to back: the order the early reads read them in.
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


def _cover(path: Path, size: int, pieces: list[Piece], chunk: int,
           chunks: set[int] | None = None, own: set[int] | None = None) -> list[Job]:
    """Jobs reading [0, size) (or its `chunks`) on the chunk grid, with the pieces they hold."""
    span = grid_span(chunk)
    pieces = sorted(pieces, key=lambda p: p.file_offset)
    spans = cover_spans(size, span) if chunks is None else share_spans(size, span, chunks, own)
    return _assign([Job(path, start, end, digest=True) for start, end in spans], pieces)


def _assign(jobs: list[Job], pieces: list[Piece]) -> list[Job]:
    """Each piece's bytes to the jobs that read them (jobs and pieces in file order)."""
    index = 0
    for piece in pieces:
        pos, left, dst = piece.file_offset, piece.nbytes, piece.arena_offset
        while left:
            while jobs[index].end <= pos:
                index += 1
            job = jobs[index]
            take = min(left, job.end - pos)
            job.pieces.append(Piece(pos, take, dst))
            pos, left, dst = pos + take, left - take, dst + take
    return jobs


class _Reader:
    """Per-thread state: open files, two pinned buffers, one stream."""

    def __init__(self, device: torch.device, chunk: int, direct: bool | str,
                 opened: dict[Path, int] | None = None,
                 cpu: threading.Semaphore | None = None, disk: DiskShare | None = None,
                 hot_step: int = HOT_STEP) -> None:
        t0 = time.perf_counter()
        self.opened = opened or {}  # path -> fd opened before the load: read that inode
        self.cpu = cpu or threading.Semaphore(1)  # shared by the load's readers (cpu_slots)
        self.disk = disk  # the direct reads yield to other readers of the disk (diskshare)
        self.chunk = chunk
        self.span = span_of(chunk)  # file bytes per read; alignment slack fits in `chunk`
        self.hot_step = hot_step  # whole content chunks (hot_step): a piece's hash starts on one
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
        self.early_bytes = 0  # copied from the early reads (`stage`), not read here
        self.read_seconds = 0.0
        self.wait_seconds = 0.0
        self.hash_seconds = 0.0
        self.ready_at = time.perf_counter()
        self.setup_seconds = self.ready_at - t0

    def fd(self, path: Path, direct: bool) -> int:
        key = (path, direct)
        if key not in self.fds:
            if len(self.fds) >= MAX_OPEN_PER_THREAD:  # a checkpoint of thousands of files
                self.close()
            flags = os.O_RDONLY | os.O_CLOEXEC | (getattr(os, "O_DIRECT", 0) if direct else 0)
            base = self.opened.get(path)
            # The inode opened before the load, even if the path now names another file.
            self.fds[key] = os.open(f"/proc/self/fd/{base}" if base is not None else path, flags)
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

    def _next_buffer(self) -> torch.Tensor:
        slot = self.turn
        self.turn ^= 1
        event = self.events[slot]
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()  # the copies out of this buffer have finished
            self.wait_seconds += time.perf_counter() - t0
        return self.buffers[slot]

    def read(self, path: Path, start: int, end: int,
             hash_piece: Callable[[memoryview, int], None] | None = None
             ) -> tuple[torch.Tensor, int]:
        """Read [start, end) into the next free pinned buffer; (buffer, skip) where data starts.

        `hash_piece(bytes, file_offset)` sees every byte read, on the chunk grid: through the
        page cache in `hot_step` pieces, each hashed right after its copy while the CPU's cache
        still holds it (one pass over memory fewer: the warm load is memory-bound), after an
        O_DIRECT read (the device wrote it; no cache to win) in one piece.
        """
        buf = self._next_buffer()
        t_read = time.perf_counter()
        direct = self._use_direct(path, start, end)
        lo = start - start % PAGE if direct else start
        hi = end + (-end) % PAGE if direct else end
        view = memoryview(buf.numpy())[: hi - lo]
        got = 0
        if not direct and hash_piece is not None:
            with self.cpu:
                got = self._read_hot(self.fd(path, False), view, lo, hash_piece)
            hash_piece = None
        elif not direct:
            with self.cpu:
                got = read_fully(self.fd(path, False), view, lo)
        else:
            try:
                got = read_fully(self.fd(path, True), view, lo, self.disk)
            except OSError:
                # The file system refuses O_DIRECT (tmpfs, overlay): buffered reads from now on.
                self.mode = direct = False
                lo, hi = start, end
                view = memoryview(buf.numpy())[: hi - lo]
                with self.cpu:
                    got = read_fully(self.fd(path, False), view, lo)
        if got < end - lo:
            raise ContentError(f"{path}: only {got} of {end - lo} bytes at offset {lo}: the file "
                               "was truncated or replaced while it was being loaded")
        if hash_piece is not None:
            t0 = time.perf_counter()
            with self.cpu:
                hash_piece(view[start - lo : end - lo], start)
            self.hash_seconds += time.perf_counter() - t0
        self.read_seconds += time.perf_counter() - t_read
        self.read_bytes += got
        if direct:
            self.direct_bytes += got
        else:
            self.cached_bytes += got
        return buf, start - lo

    def _read_hot(self, fd: int, view: memoryview, offset: int,
                  hash_piece: Callable[[memoryview, int], None]) -> int:
        got = 0
        while got < len(view):
            want = min(self.hot_step, len(view) - got)
            n = read_fully(fd, view[got : got + want], offset + got)
            if n:
                t0 = time.perf_counter()
                hash_piece(view[got : got + n], offset + got)
                self.hash_seconds += time.perf_counter() - t0
            got += n
            if n < want:
                break  # the file ends here
        return got

    def stage(self, data: Any, hash_piece: Callable[[memoryview, int], None] | None = None,
              offset: int = 0) -> torch.Tensor:
        """Copy bytes already in host memory (an early read) into the next free buffer,
        hashing each `hot_step` piece right after its copy."""
        buf = self._next_buffer()
        out = buf.numpy()
        with self.cpu:
            for at in range(0, len(data), self.hot_step):
                piece = data[at : at + self.hot_step]
                np.copyto(out[at : at + len(piece)], piece)  # releases the GIL
                if hash_piece is not None:
                    t0 = time.perf_counter()
                    hash_piece(memoryview(out[at : at + len(piece)]), offset + at)
                    self.hash_seconds += time.perf_counter() - t0
        self.cached_bytes += len(data)
        self.early_bytes += len(data)
        return buf

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


def _run_job(reader: _Reader, job: Job, flat: torch.Tensor, sink: ChunkSink | None,
             early: EarlyReads | None = None) -> None:
    if job.entry is None:
        if job.start == job.end:  # an empty file: its one chunk is empty
            if job.digest and sink is not None:
                sink.add(job.path, 0, b"")
            return
        hash_piece = None
        if job.digest and sink is not None:
            path = job.path

            def hash_piece(data: memoryview, offset: int) -> None:
                sink.add(path, offset // CHUNK_BYTES, data)

        found = early.take(job.path, job.start, job.end) if early is not None and job.digest \
            else None
        if found is not None:  # read while the rank started: a memory copy, no disk
            buf, skip = reader.stage(found, hash_piece, job.start), 0
            del found
        else:
            buf, skip = reader.read(job.path, job.start, job.end, hash_piece)
        if not reader.cuda:
            # Host to host: one plain memcpy per piece (releases the GIL). torch's CPU copy_
            # splits each into the intra-op thread pool, which all the loader's readers then
            # share: on the H200 host, 32 readers staging an update that way ran 2.5 GB/s.
            out, src = flat.numpy(), buf.numpy()
            with reader.cpu:
                for piece in job.pieces:
                    at = skip + piece.file_offset - job.start
                    np.copyto(out[piece.arena_offset : piece.arena_offset + piece.nbytes],
                              src[at : at + piece.nbytes])
            return
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


def hot_step(slots: int) -> int:
    """The piece a page-cache read is hashed in, in whole content chunks: for a fill whose CPU
    work runs in `slots` readers at once, HOT_STEP_WIDE from WIDE_SLOTS up, else HOT_STEP;
    `WEIGHTCACHE_LOAD_HOT_STEP_MIB` sets it for any."""
    step = loadenv.hot_step(HOT_STEP_WIDE if slots >= WIDE_SLOTS else HOT_STEP)
    return max(CHUNK_BYTES, step - step % CHUNK_BYTES)


def _job_nbytes(job: Job) -> int:
    """Arena bytes a job fills (what progress counts)."""
    if job.entry is not None:
        return int(job.entry.nbytes)
    return sum(p.nbytes for p in job.pieces)


def load_entries(
    entries: list[Any],
    flat: torch.Tensor,
    *,
    threads: int | None = None,
    chunk: int | None = None,
    direct: bool | str | None = None,
    progress: Callable[[int], None] | None = None,
    digest: list[Path | str] | None = None,
    share: bool = False,
    early: EarlyReads | None = None,
    disk: DiskShare | None = None,
) -> LoadStats:
    """Fill the arena `flat` (uint8, 1-D; CUDA or CPU) with loader `Entry` objects.

    Tuning comes from the arguments or `WEIGHTCACHE_LOAD_THREADS`, `WEIGHTCACHE_LOAD_CHUNK_MIB`,
    `WEIGHTCACHE_LOAD_DIRECT` and `WEIGHTCACHE_LOAD_IO_PRIORITY` (loadenv.py); `progress(n)`
    is called (from the loader's threads) with the arena bytes of each finished read as they
    are queued to the device. With `digest`
    (the checkpoint's files), those files are read whole and `stats.record` is their content
    record, from the same pass; with `share`, only the chunks the entries read (a
    tensor-parallel rank's share, `share_chunks`). With `early` (and `digest`), the jobs it
    holds come from its memory: whole files' jobs, or a tensor-parallel rank's (tpshare.py).
    The direct reads yield to programs starting beside the load (`disk`, else the early
    reads' share, else one of its own: diskshare.py). Raises ContentError when a file changed
    under the load; an exception in the caller's thread (a signal's) stops every reader
    before it propagates.
    Returns what was moved and how fast.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("the arena must be a flat uint8 tensor")
    # A CPU arena has no copy engine to keep busy: a few readers per core are enough.
    default = DEFAULT_THREADS if flat.is_cuda else min(DEFAULT_THREADS, 2 * cgroups.usable_cpus())
    chunk = chunk or loadenv.chunk()  # the early reads cut their jobs with the same size
    chunk = max(4 * PAGE, chunk - chunk % PAGE)
    mode = loadenv.direct() if direct is None else loadenv.direct_mode(direct)
    if not hasattr(os, "O_DIRECT"):
        mode = False
    idle = loadenv.idle()
    opened: dict[Path, int] = {}
    disk, mine = for_load(disk or (early.disk if early is not None else None))
    try:
        sink = _open_files(entries, digest, opened, share)
        if _all_resident(opened):
            # No disk to keep busy: one reader per core does the copies and the hashing (the
            # fill's CPU work never runs in more threads than its CPU slots anyway), and a
            # CUDA fill sets up half as many pinned buffers.
            default = cpu_slots(DEFAULT_THREADS)
        # The knobs never fail a load (an engine's disk fallback): a bad one is its default
        # here, and a daemon's rank refused it before loading (loadenv.py).
        threads = threads or loadenv.threads(default)
        if early is not None:
            early.accept({p: FileIdentity.of(os.fstat(fd)) for p, fd in opened.items()}
                         if sink is not None else {})
        stats = _load(entries, flat, threads, chunk, mode, progress, sink, opened, early, idle,
                      disk)
        if disk is not None:
            stats.disk = disk.stats()
        return stats
    finally:
        if mine and disk is not None:
            disk.stop()
        for fd in opened.values():
            os.close(fd)


def _open_files(entries: list[Any], digest: list[Path | str] | None,
                opened: dict[Path, int], share: bool = False) -> ChunkSink | None:
    """Open every file once, before any read (their identities bracket the load)."""
    paths = {Path(e.source.file) for e in entries} | {Path(p) for p in digest or ()}
    idents = {}
    for path in sorted(paths):
        try:
            opened[path] = fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ContentError(f"{path} disappeared before it was loaded") from None
        idents[path] = FileIdentity.of(os.fstat(fd))
    for e in entries:  # the headers were read earlier: the file may be shorter by now
        size = idents[Path(e.source.file)].size
        if e.nbytes and e.source.offset + e.source.nbytes > size:
            raise ContentError(f"{e.source.file} holds {size} bytes but its header places "
                               f"{e.name!r} up to byte {e.source.offset + e.source.nbytes}: "
                               "truncated or replaced since it was opened")
    if digest is None:
        return None
    return ChunkSink({Path(p): idents[Path(p)] for p in digest},
                     coverage=share_chunks(entries) if share else None)


def _all_resident(opened: dict[Path, int]) -> bool:
    """The page cache holds every opened file whole (a warm load)."""
    return bool(opened) and all(resident(fd, 0, os.fstat(fd).st_size)
                                for fd in opened.values())


def _check_unchanged(sink: ChunkSink, opened: dict[Path, int]) -> None:
    """Every digested file is still the very file, unchanged, that the load began with."""
    for path, before in sink.identities.items():
        try:
            now = FileIdentity.of(os.stat(path))
        except FileNotFoundError:
            raise ContentError(f"{path} was removed while it was being loaded") from None
        if FileIdentity.of(os.fstat(opened[path])) != before:
            raise ContentError(f"{path} was written or truncated while it was being loaded")
        if now != before:
            raise ContentError(f"{path} was replaced while it was being loaded")


def _load(entries: list[Any], flat: torch.Tensor, threads: int, chunk: int, mode: bool | str,
          progress: Callable[[int], None] | None, sink: ChunkSink | None,
          opened: dict[Path, int], early: EarlyReads | None = None, idle: bool = False,
          disk: DiskShare | None = None) -> LoadStats:
    stats = LoadStats(threads=threads, chunk=chunk, direct=mode)
    stats.nbytes = sum(e.nbytes for e in entries)
    cover = {p: i.size for p, i in sink.identities.items()} if sink is not None else None
    jobs = plan_jobs(entries, span_of(chunk), cover,
                     None if sink is None or sink.coverage is None else sink.coverage,
                     early.own if early is not None else None)
    # Buffers as large as the largest read (small loads need small ones; a digested job
    # spans whole content chunks).
    largest = max((j.end - j.start if j.entry is None else min(j.end - j.start, span_of(chunk))
                   for j in jobs), default=0)
    chunk = max(4 * PAGE, largest + (-largest) % PAGE + 2 * PAGE)
    stats.staged_tensors = sum(1 for j in jobs if j.entry is not None)
    if early is not None:
        jobs = _interleave(jobs, early)
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
    slots = cpu_slots(count)
    cpu = threading.Semaphore(slots)
    stats.hot_step = hot_step(slots)

    def worker(_: int) -> None:
        reader = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if idle:
                idle_io_priority()
            reader = _Reader(device, chunk, mode, opened, cpu, disk, stats.hot_step)
            while True:
                job = work.get()
                if job is None or errors:
                    break
                _run_job(reader, job, flat, sink, early)
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

    pool = Pool(worker, count, "coldload")
    try:
        pool.start().wait()
    except BaseException as exc:  # a signal's exception: stop the readers, then go
        errors.append(exc)
        pool.close()  # never Thread.join after a signal: it can lose a running thread (threads.py)
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - t0
    stats.read_bytes = sum(r.read_bytes for r in readers)
    stats.cached_bytes = sum(r.cached_bytes for r in readers)
    stats.direct_bytes = sum(r.direct_bytes for r in readers)
    stats.setup_seconds = max((r.setup_seconds for r in readers), default=0.0)
    stats.ready_seconds = max((r.ready_at - t0 for r in readers), default=0.0)
    stats.read_seconds = sum(r.read_seconds for r in readers)
    stats.wait_seconds = sum(r.wait_seconds for r in readers)
    stats.hash_seconds = sum(r.hash_seconds for r in readers)
    stats.early_bytes = sum(r.early_bytes for r in readers)
    if errors:
        raise errors[0]
    if sink is not None:
        _check_unchanged(sink, opened)
        stats.record = sink.record()
    return stats


def _interleave(jobs: list[Job], early: EarlyReads) -> list[Job]:
    """The disk's jobs in their order, with the early-read ones spread evenly among them: the
    disk stays busy from the first moment, and the memory copies fill its waits."""
    held: list[Job] = []
    rest: list[Job] = []
    for j in jobs:
        (held if j.entry is None and early.holds(j.path, j.start, j.end) else rest).append(j)
    if not held:
        return jobs
    out: list[Job] = []
    step = len(rest) / len(held)
    k = 0
    for i, job in enumerate(rest):
        while k < len(held) and k * step <= i:
            out.append(held[k])
            k += 1
        out.append(job)
    out.extend(held[k:])
    return out


def load_layout(layout: Any, flat: torch.Tensor, **kwargs: Any) -> LoadStats:
    """Entry point for the daemon's loader (`loader.load_into_arena`)."""
    return load_entries(list(layout.entries), flat, **kwargs)


def drop_page_cache(paths: list[Path | str], *, everything: bool = True) -> bool:
    """Evict the files from the page cache; True when the global drop also worked.

    `posix_fadvise(DONTNEED)` works for any user on clean pages of these files; writing
    /proc/sys/vm/drop_caches (root only, and only with `everything`) drops everything else.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not everything:
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False
