"""Content identity of checkpoint files: per-chunk digests, file identities, sampled checks.

Headers alone say nothing about values: a fine-tune, an RL step or a new revision written
over the same path has the same names, dtypes and shapes as the weights a daemon holds. So the
daemon digests every byte of every file while it loads them (it reads them anyway): BLAKE3
cut to 16 bytes (`blake3-128`) of each CHUNK_BYTES chunk, hashed by the loader's reader threads
from the buffers the bytes land in. BLAKE3 because the digest sits on the load's critical path
and must resist constructed collisions (another tenant's checkpoint must never pass for
ours): measured per core it ran 2.5-4x SHA-256 with SHA instructions (docs/performance.md),
and it releases the GIL. Without the `blake3` wheel the same record uses SHA-256 cut to 16
bytes (`sha256-128`); the hash is named in every record and claim, so two sides that differ
refuse the claim (a disk load, never a false match). The record of a file is those chunk
digests, its root (a digest
of the chunk digests and the size) and the file's identity (st_dev, st_ino, size, mtime_ns,
ctime_ns) taken before and checked after reading.

An engine cannot afford to read the checkpoint to prove it matches, so the client sends a
*claim*: each file's identity and path plus the digests of a few random chunks it read
(`sample_claim`, milliseconds). `verify_claim` (the daemon) accepts it only if

- the same file names and sizes are claimed, with the same chunk size;
- a file at the path the daemon read, or with the inode it read, still has exactly the
  identity the daemon recorded (any write changes mtime/ctime, a replacement changes the
  inode): a checkpoint rewritten in place or replaced by rename is refused with certainty;
- every sampled chunk digest equals the daemon's.

What that guarantees is written down in docs/native.md ("Exact identity"). This module is
the one place that defines "digest of a shard's content": `digest_file`/`digest_files` give
a `FileDigest` per file, `content_root` one hex string for a set of files (what `hello`
reports as `content` and what `weightcache digest` prints for an audit).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.errors import ProjectError

from . import cgroups
from .checkpoint import CheckpointError, open_checkpoint

try:  # the `native` extra installs it; without it the slower standard-library hash
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised where the wheel is missing
    _blake3 = None

# 1 MiB: each chunk costs a few interpreter steps under the GIL besides its hash (which
# releases it), and 32 reader threads hashing 256 KiB chunks were bound by those steps: on the
# H200 host a warm fill of 32 readers ran 5.8 GB/s with 256 KiB chunks, 14-22 GB/s with 1 MiB
# (tests/gpu/probe_io.py, docs/performance.md). A claim reads 8 chunks: 8 MiB, milliseconds.
CHUNK_BYTES = 1024 * 1024
DIGEST_BYTES = 16
# Named in every record and claim: another hash is another identity.
HASH = "blake3-128" if _blake3 is not None else "sha256-128"
SAMPLES_PER_FILE = 2  # at least this many chunks of every file (all of a smaller file)
SAMPLES_TOTAL = 8  # at least this many chunks over the whole checkpoint
MAX_FILES = 4096  # a claim naming more files is refused (bounded client-supplied state)
MAX_SAMPLES_PER_FILE = 64
CLAIM_THREADS = 8  # one per sampled chunk of a claim of SAMPLES_TOTAL
_TASK_CHUNKS = 64  # chunks per thread-pool task (16 MiB)


class ContentError(ProjectError, RuntimeError):
    """A file could not be digested, or changed while it was being digested."""


@dataclass(frozen=True)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def as_list(self) -> list[int]:
        return [self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns]


@dataclass(frozen=True)
class FileDigest:
    name: str  # base name: the same files in another directory are the same content
    path: str  # absolute real path the daemon read
    identity: FileIdentity
    chunk_bytes: int
    chunks: bytes  # DIGEST_BYTES per chunk, in order (zeros where not `covered`)
    hash: str = HASH
    # None: every chunk. Otherwise the chunks one tensor-parallel rank reads (`share`): its
    # claims sample only those, as the client computes them from its own layout.
    covered: frozenset[int] | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.chunks) // DIGEST_BYTES

    def chunk(self, index: int) -> bytes:
        return self.chunks[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]

    @property
    def root(self) -> str:
        """The file's full content digest (hex): chunk size, size and every chunk digest."""
        h = hashlib.sha256()
        h.update(f"{self.chunk_bytes}:{self.identity.size}:".encode())
        if self.covered is None:
            h.update(self.chunks)
            return h.hexdigest()
        h.update(b"share:")
        for index in sorted(self.covered):
            h.update(index.to_bytes(8, "little") + self.chunk(index))
        return h.hexdigest()


def chunk_digest(data: bytes | memoryview) -> bytes:
    if _blake3 is not None:
        return _blake3(data).digest(DIGEST_BYTES)
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def n_chunks(size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, math.ceil(size / chunk_bytes))


class ChunkSink:
    """Chunk digests of a set of files, filled in any order by the threads that read them.

    The loader calls `add(path, first, view)` with bytes that start on the chunk grid (and
    run to the file's end or a grid line); `record` refuses to build a record with a chunk
    nobody hashed. Each slot is written by one thread only (jobs never share a chunk), so
    no lock is needed for the bytes themselves.
    """

    def __init__(self, files: Mapping[Path, FileIdentity], chunk_bytes: int = CHUNK_BYTES,
                 coverage: Mapping[Path, set[int]] | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.identities = dict(files)
        self.coverage = None if coverage is None else {
            p: frozenset(coverage.get(p, ())) for p in self.identities}
        self._chunks = {p: bytearray(n_chunks(i.size, chunk_bytes) * DIGEST_BYTES)
                        for p, i in self.identities.items()}
        self._seen = {p: bytearray(n_chunks(i.size, chunk_bytes))
                      for p, i in self.identities.items()}

    def covers(self, path: Path) -> bool:
        return path in self._chunks

    def add(self, path: Path, first: int, data: memoryview | bytes) -> None:
        out, seen, step = self._chunks[path], self._seen[path], self.chunk_bytes
        view = memoryview(data)
        for k, at in enumerate(range(0, max(1, len(view)), step)):
            index = first + k
            out[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES] = chunk_digest(
                view[at : at + step])
            seen[index] = 1

    def record(self) -> dict[str, FileDigest]:
        out: dict[str, FileDigest] = {}
        for path, ident in self.identities.items():
            seen = self._seen[path]
            covered = None if self.coverage is None else self.coverage[path]
            wanted = range(len(seen)) if covered is None else covered
            missing = [i for i in wanted if not seen[i]]
            if missing:
                raise ContentError(f"{path}: chunk {missing[0]} was never read")
            out[path.name] = FileDigest(path.name, os.path.realpath(path), ident,
                                        self.chunk_bytes, bytes(self._chunks[path]),
                                        covered=covered)
        return out


# Chunks per read of `digest_into`: one, into each thread's own 1 MiB buffer, which stays in
# the core's cache between the copy out of the page cache and the hash (a 16 MiB buffer is
# written to memory and read back: twice the memory traffic, and staging is bound by it).
READ_CHUNKS = 1
_digest_buffers = threading.local()


def _runs(total: int, wanted: Iterable[int] | None, limit: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive chunk indices below `total`, at most `limit` long."""
    indices = range(total) if wanted is None else sorted(i for i in wanted if 0 <= i < total)
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][0] + runs[-1][1] == index and runs[-1][1] < limit:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def _digest_run(sink: ChunkSink, path: Path, fd: int, first: int, count: int,
                size: int) -> None:
    step = sink.chunk_bytes
    buf = getattr(_digest_buffers, "buf", None)
    if buf is None or len(buf) < READ_CHUNKS * step:
        buf = _digest_buffers.buf = memoryview(bytearray(READ_CHUNKS * step))
    for at in range(first, first + count, READ_CHUNKS):
        take = min(READ_CHUNKS, first + count - at)
        want = max(0, min(take * step, size - at * step))
        got = os.preadv(fd, [buf[:want]], at * step) if want else 0
        if got != want:
            raise ContentError(f"{path}: short read at chunk {at} ({got} of {want} bytes)")
        sink.add(path, at, buf[:want])


def digest_into(sink: ChunkSink, fds: Mapping[Path, int], *,
                workers: int | None = None) -> None:
    """Hash every chunk `sink` wants (all, or its coverage) of its files, open as `fds`.

    Reads with pread into each thread's own buffer, never through a mapping: a file truncated
    under a read is a short read (ContentError naming it), where a mapping would SIGBUS."""
    jobs = []
    for path, ident in sink.identities.items():
        wanted = None if sink.coverage is None else sink.coverage[path]
        for first, count in _runs(n_chunks(ident.size, sink.chunk_bytes), wanted, _TASK_CHUNKS):
            jobs.append((path, first, count, ident.size))
    workers = max(1, min(workers or cgroups.usable_cpus(), len(jobs) or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="digest") as pool:
        futures = [(path, pool.submit(_digest_run, sink, path, fds[path], first, count, size))
                   for path, first, count, size in jobs]
        for path, fut in futures:
            try:
                fut.result()
            except OSError as exc:
                raise ContentError(f"{path}: cannot read: {exc}") from None


def digest_files(
    paths: Iterable[str | os.PathLike],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
) -> dict[str, FileDigest]:
    """Digest every byte of every file (base name -> FileDigest), in parallel.

    Raises ContentError when a file cannot be read or its identity changed while it was read
    (a writer was at work: the bytes read may mix two versions).
    """
    paths = [Path(p) for p in paths]
    opened: dict[Path, int] = {}
    try:
        idents = {}
        for path in paths:
            try:
                fd = opened[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise ContentError(f"{path}: cannot read: {exc}") from None
            idents[path] = FileIdentity.of(os.fstat(fd))
        sink = ChunkSink(idents, chunk_bytes)
        digest_into(sink, opened, workers=workers or min(8, cgroups.usable_cpus()))
        for path, fd in opened.items():
            after = FileIdentity.of(os.stat(path))
            if after != idents[path] or FileIdentity.of(os.fstat(fd)) != idents[path]:
                raise ContentError(f"{path} changed while it was being read; load it again")
        return sink.record()
    except FileNotFoundError as exc:
        raise ContentError(f"{exc.filename} disappeared while it was being read") from None
    finally:
        for fd in opened.values():
            os.close(fd)


def digest_file(path: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES) -> FileDigest:
    return digest_files([path], chunk_bytes=chunk_bytes)[Path(path).name]


def content_root(digests: Mapping[str, FileDigest]) -> str:
    """One hex digest for a set of files, keyed by base name (not path)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name].root}\0".encode())
    return h.hexdigest()


# -- the client's claim and the daemon's check --------------------------------------------
def _sample_counts(sizes: Mapping[str, int], chunk_bytes: int) -> dict[str, int]:
    total = sum(sizes.values()) or 1
    out = {}
    for name, size in sizes.items():
        n = n_chunks(size, chunk_bytes)
        share = math.ceil(SAMPLES_TOTAL * size / total)
        out[name] = min(n, max(SAMPLES_PER_FILE, share), MAX_SAMPLES_PER_FILE)
    return out


_claim_buffers = threading.local()


def _sampled_digest(fd: int, index: int) -> bytes:
    """One chunk's digest, read into its thread's own buffer: a fresh 1 MiB per read would be
    a new mapping to fault in and give back each time."""
    buf = getattr(_claim_buffers, "buf", None)
    if buf is None:
        buf = _claim_buffers.buf = memoryview(bytearray(CHUNK_BYTES))
    got = os.preadv(fd, [buf], index * CHUNK_BYTES)
    return chunk_digest(buf[:got])


_claim_pool: tuple[int, ThreadPoolExecutor] | None = None
_claim_pool_lock = threading.Lock()


def _claim_executor() -> ThreadPoolExecutor:
    """The claim's reader threads, kept for the process: a claim is on every attach's
    critical path, and starting 8 threads for each would cost about as much as they save.
    Keyed by pid: a forked child (vLLM starts its workers so) has none of its parent's
    threads, and a pool inherited from the parent would never run a task."""
    global _claim_pool
    with _claim_pool_lock:
        if _claim_pool is None or _claim_pool[0] != os.getpid():
            _claim_pool = (os.getpid(), ThreadPoolExecutor(
                max_workers=CLAIM_THREADS, thread_name_prefix="weightcache-claim"))
        return _claim_pool[1]


class PendingClaim:
    """A claim whose chunks are still being read and hashed on the claim's threads.

    `identities` are known at once (fstat of each file as it was opened): an attach checks
    its kept plan with them and talks to the daemon while the chunks hash (the claim is
    needed only by `get_state`). `result()` waits for the digests. The files' descriptors
    are closed by whichever task finishes last, so a claim nobody asks for leaks nothing.
    """

    def __init__(self, handles: list[tuple[Path, int, FileIdentity]],
                 picked: list[list[int]]) -> None:
        self._handles = [(path, ident) for path, _, ident in handles]
        self._picked = picked
        fds = [fd for _, fd, _ in handles]
        picks = [(fd, index) for fd, chunk_picks in zip(fds, picked, strict=True)
                 for index in chunk_picks]
        self._futures: list[Future[bytes]] = []
        self._left = len(picks)
        self._lock = threading.Lock()
        self._fds = fds
        if self._left == 0:
            self._close()
            return
        submitted = 0
        if len(picks) > 1:
            try:
                pool = _claim_executor()
                for fd, index in picks:
                    future = pool.submit(_sampled_digest, fd, index)
                    future.add_done_callback(self._one_done)
                    self._futures.append(future)
                    submitted += 1
            except RuntimeError:  # no new threads (interpreter shutdown, a thread limit)
                pass
        for fd, index in picks[submitted:]:  # here, where no thread could take them
            future = Future()
            try:
                future.set_result(_sampled_digest(fd, index))
            except BaseException as exc:
                future.set_exception(exc)
            future.add_done_callback(self._one_done)
            self._futures.append(future)

    @property
    def identities(self) -> tuple[tuple[int, ...], ...]:
        """Each file's identity, in the claim's order (plancache.claimed_identities)."""
        return tuple(tuple(ident.as_list()) for _, ident in self._handles)

    def _one_done(self, _: Future[bytes]) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._close()

    def _close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def result(self) -> dict[str, Any]:
        """The claim (sample_claim's); raises OSError when a chunk could not be read."""
        wait(self._futures)
        digests = iter([f.result() for f in self._futures])
        files = {path.name: {"path": os.path.realpath(path), "identity": ident.as_list(),
                             "samples": [[index, next(digests)] for index in picks]}
                 for (path, ident), picks in zip(self._handles, self._picked, strict=True)}
        return {"chunk": CHUNK_BYTES, "hash": HASH, "files": files}


def start_claim(
    paths: Iterable[str | os.PathLike],
    *,
    rng: random.Random | None = None,
    coverage: Mapping[str, Iterable[int]] | None = None,
) -> PendingClaim:
    """`sample_claim`, with the chunks read and hashed on the claim's threads meanwhile
    (pread and BLAKE3 release the GIL: serially, 8 chunks of 1 MiB took 3.2 ms of an attach
    on the H200 host). Raises OSError when a file cannot be opened."""
    rng = rng or random.SystemRandom()
    handles: list[tuple[Path, int, FileIdentity]] = []
    try:
        sizes = {}
        for path in paths:
            path = Path(path)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            handles.append((path, fd, FileIdentity.of(os.fstat(fd))))
            sizes[path.name] = handles[-1][2].size
        counts = _sample_counts(sizes, CHUNK_BYTES)
        picked = []
        for path, _fd, ident in handles:
            pool = range(n_chunks(ident.size)) if coverage is None else sorted(
                set(coverage.get(path.name, ())))
            picked.append(sorted(rng.sample(pool, min(len(pool), counts[path.name]))))
    except BaseException:
        for _, fd, _ in handles:
            os.close(fd)
        raise
    return PendingClaim(handles, picked)


def sample_claim(
    paths: Iterable[str | os.PathLike],
    *,
    rng: random.Random | None = None,
    coverage: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, Any]:
    """What the client asserts about the files it would load: identities and sampled digests.

    Reads a few random chunks per file (SAMPLES_PER_FILE, SAMPLES_TOTAL); with `coverage`
    (base name -> chunk indices: a tensor-parallel rank's share, `coldload.share_chunks`)
    only among those. Raises OSError when a file cannot be read.
    """
    return start_claim(paths, rng=rng, coverage=coverage).result()


def _bad_claim(claim: Any) -> str | None:
    """Shape check of a client-supplied claim: bounded, and only the types we expect."""
    if not isinstance(claim, dict) or set(claim) != {"chunk", "hash", "files"}:
        return "claim must be a map with exactly chunk, hash and files (an older client?)"
    files = claim["files"]
    if not isinstance(claim["chunk"], int) or not isinstance(files, dict):
        return "claim has a bad chunk size or file map"
    if not isinstance(claim["hash"], str) or len(claim["hash"]) > 64:
        return "claim has a bad hash name"
    if len(files) > MAX_FILES:
        return f"claim names more than {MAX_FILES} files"
    for name, entry in files.items():
        if not isinstance(name, str) or len(name) > 255 or not isinstance(entry, dict):
            return "claim has a bad file entry"
        path, ident, samples = entry.get("path"), entry.get("identity"), entry.get("samples")
        if set(entry) != {"path", "identity", "samples"} or not isinstance(path, str) \
                or len(path) > 4096:
            return f"claim for {name[:64]!r} is malformed"
        if not isinstance(ident, list) or len(ident) != 5 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in ident):
            return f"claim for {name[:64]!r} has a bad identity"
        if not isinstance(samples, list) or len(samples) > MAX_SAMPLES_PER_FILE or not all(
                isinstance(s, list) and len(s) == 2 and isinstance(s[0], int)
                and isinstance(s[1], bytes) for s in samples):
            return f"claim for {name[:64]!r} has bad samples"
    return None


def verify_claim(record: Mapping[str, FileDigest], claim: Any) -> str | None:
    """None when the claim matches the record; otherwise why not (one line)."""
    bad = _bad_claim(claim)
    if bad:
        return bad
    if not record:
        # Bytes pushed by a process (no checkpoint on disk): no claim can match them.
        return "no checkpoint on disk holds the served bytes"
    if claim["chunk"] != CHUNK_BYTES or any(d.chunk_bytes != CHUNK_BYTES for d in record.values()):
        return f"chunk size {claim['chunk']} differs from {CHUNK_BYTES}"
    kinds = {d.hash for d in record.values()}
    if kinds != {claim["hash"]}:
        return f"the claim's digests are {claim['hash']!r}, the cache's {sorted(kinds)}"
    files = claim["files"]
    if set(files) != set(record):
        return "the checkpoint holds other files"
    for name, entry in files.items():
        mine = record[name]
        ident = FileIdentity(*entry["identity"])
        if ident.size != mine.identity.size:
            return f"{name}: {ident.size} bytes, cached {mine.identity.size}"
        same_file = entry["path"] == mine.path or (ident.dev, ident.ino) == (
            mine.identity.dev, mine.identity.ino)
        if same_file and ident != mine.identity:
            return f"{name} was rewritten since it was cached (mtime/ctime/inode changed)"
        if not entry["samples"] and (mine.covered if mine.covered is not None else mine.n_chunks):
            return f"{name}: no sampled chunks"
        for index, digest in entry["samples"]:
            if not 0 <= index < mine.n_chunks:
                return f"{name}: chunk {index} is out of range"
            if mine.covered is not None and index not in mine.covered:
                return f"{name}: chunk {index} is not in this rank's share"
            if digest != mine.chunk(index):
                return f"{name}: chunk {index} differs from the cached bytes"
    return None


# -- `weightcache digest`: the full digest, for an audit ------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="weightcache digest",
        description="full content digest of a checkpoint, as a daemon reports it in hello",
    )
    p.add_argument("--model", required=True, help="safetensors checkpoint directory")
    args = p.parse_args(argv)
    try:
        ckpt = open_checkpoint(args.model)
        digests = digest_files(ckpt.files)
    except (CheckpointError, ContentError) as exc:
        print(f"weightcache digest: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({
        "content": content_root(digests),
        "chunk_bytes": CHUNK_BYTES,
        "hash": HASH,
        "files": {n: {"bytes": d.identity.size, "root": d.root}
                  for n, d in sorted(digests.items())},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
