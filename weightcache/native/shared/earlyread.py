"""Read and digest the start of a rank's checkpoint while the rank is still starting (torch-free).

A rank spends seconds before it can put a byte into GPU memory: the interpreter, `import
torch`, the CUDA context, the arena (3.8-5.0 s measured on the H200, against a 16 GB checkpoint
the disk reads in 8.5-10 s). Those seconds are CPU work; the disk is idle. `EarlyReads` starts
right after the rank holds its lock, before torch is imported, and reads the files the fill
will read, in the fill's own jobs (the content chunk grid, `cover_spans`), straight into
anonymous host mappings (one a file), each file as soon as the pool's opener has opened it.
When the fill starts it takes those jobs from memory (`take`: a memory
copy into its pinned buffers, hashed there like any other job) and reads the rest itself.
The early reads go on beside the fill (`accept`), on the jobs that neither has begun: a job
is claimed once, by whichever asks first (the fill's `take` of a job not begun claims it), and
the fill waits for a job the early reads have in flight rather than read it again. Stopping
them when the fill began left the disk short at the worst moment: on the H200 its queue fell
from about 120 reads to 3-11 for 0.25-0.5 s while the fill's 32 readers started (threads,
streams, pinned buffers), in every layout, and from then on half of the fill's readers were
copying early jobs instead of reading (16 reads in flight, not 32). After `accept` the early
readers read at the normal I/O priority: the idle class was for the start, and a scheduler
that honours it (mq-deadline) would put them behind the fill's own reads while the fill waits
for them (`WEIGHTCACHE_EARLY_READS_BESIDE_FILL=0` stops them when the fill begins, the
earlier way, kept to compare).

A job the fill reaches before any early read began it is the fill's: it reads it itself,
beside the early readers. `WEIGHTCACHE_EARLY_READS_FOR_FILL=1` has an early reader read it
next instead, for the fill (`take` asks), so that the disk keeps one set of readers: on an
H100 VM (run44) the disk's queue had risen from about 120 requests to 190-200 once the fill
read beside the early reads, and its rate fell from 2.9 GB/s to 2.7. Measured as an A/B on
another H100 VM (run47, `weightcache bench load`'s `fillreads` part, the model cold), asking
was no faster on `sharded` (READY 7.164 / 7.368 s asking, 7.357 / 7.209 s not) and slower on
`many` (7.532 s against 7.302 / 7.192 s): the fill's own reads add to the disk's depth more
than they take from it. So it is off by default, kept to compare on other disks. Never where
the file system refuses O_DIRECT: there the few buffered early readers would be the fill's
only ones.

While the rank starts, an early reader reads READ_JOBS consecutive jobs of one file with one
call (`preadv` into each job's place in the mapping): 32 x 64 MiB in flight, as the device
read keeps, instead of 32 x 16 MiB. The reads are Python threads, and `import torch` holds the
GIL for 0.18-0.37 s at a time (loading its extension libraries; tests/gpu/probe_gil.py on an
H100 VM, run48): a reader whose read landed cannot ask for the next until the GIL comes back,
so the disk drains what is in flight, 0.2 s of it at 16 MiB a read, 0.8 s at 64 MiB. Once the
fill began (`accept`) and while the reads are gentle, a reader reads one job per call again:
the fill waits for the jobs it takes, and a gentle share allows small pieces only.
`WEIGHTCACHE_EARLY_READ_JOBS=1` reads a job per call throughout (the earlier way, kept to
compare). `WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL=4` keeps 64 MiB calls beside the fill too:
the disk read 16 MiB calls 4-9% slower than 64 MiB ones on the H200 (a device read at each,
run14), the fill's rate on an H100 VM (run50) trailed the rate the same disk kept while the
rank started (2.3 against 2.5 GB/s), and the early reads' calls need no pinned memory, unlike
the fill's own. Measured (`weightcache bench load`'s `groupbeside` part, run54 on an H100 VM,
three layouts in turn): the early readers then read the whole checkpoint, and READY stayed
within 0.05 s of the default's; so one job per call stays the default, the knob kept to
compare on other disks.

The early reads do not hash: while torch imports, its thread must keep a CPU to itself (a
read that is not O_DIRECT is a kernel memory copy that wants a CPU too: where the file
system refuses O_DIRECT, only BUFFERED_THREADS read).

Why not warm the page cache instead (what a prefetcher does): the page cache may evict what was
read before the fill wants it, and buffered reads from many threads defeat readahead. Here each
byte is read once, with O_DIRECT where the page cache lacks it, and hashed once (by the fill).

Three things keep the early reads from slowing the start they overlap (measured on the H200: the
import took 2x longer beside them until both were in): a range the page cache already holds
is left to the fill (copying it early is CPU work beside the import for no disk time saved),
the early threads' reads go at the idle I/O priority (`ioprio_set(2)`), and while the
import faults its libraries in from a cold disk the reads go gentle (`diskshare.DiskShare`:
2 x 1 MiB in flight instead of 32 x 16 MiB; the idle priority alone did not help, because
the device's queue holds every read the scheduler could have put behind the import's).

Correctness does not depend on any of this: a file is used only if the fill opens the very
file the early reads read, unchanged (the same `FileIdentity`, taken before the first early
read; the fill's own identities bracket the whole load, so a write at any time is caught), a
short read drops its job, and any error leaves the job to the fill. The memory is bounded
(`budget`) and given back when the fill ends (`close`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache import constants

from . import cgroups, loadenv
from .content import CHUNK_BYTES, FileIdentity
from .diskshare import DiskShare, idle_io_priority, normal_io_priority
from .residency import resident
from .threads import Pool

if TYPE_CHECKING:  # numpy is imported by `take`, in the fill: not before the import set
    import numpy as np

MiB = 1 << 20
PAGE = loadenv.PAGE
# O_DIRECT reads wait on the disk, not on a CPU: as many in flight as the fill keeps (32 x
# 16 MiB ran at 1.85 GB/s on the H200's virtual disk, 8 at 1.75). Where a file system refuses
# O_DIRECT, every read is a kernel memory copy that wants a CPU beside the import: then only
# BUFFERED_THREADS keep reading.
DEFAULT_THREADS = 32
BUFFERED_THREADS = 4
READ_JOBS = 4  # consecutive jobs one reader reads with one call while the rank starts
MAX_READ_JOBS = 64  # a knob's bound: one call's pieces stay far below IOV_MAX (1024)
STOP_POLL_S = 0.05  # how often readers waiting for `after` look whether they were stopped
# About what the disk reads while torch starts: 8 GiB ran out before the fill began on the H200 when
# the start took 4.4-7 s (run20, every early read budget-bound, the disk idle until the fill).
MAX_BUDGET = 16 << 30
MAX_OPEN_PER_THREAD = 32  # O_DIRECT descriptors a reader keeps open, as the fill's readers do
BUDGET_ENV = "WEIGHTCACHE_LOAD_EARLY_MIB"  # host memory for early reads; 0 turns them off
BESIDE_ENV = constants.ENV_EARLY_READS_BESIDE_FILL
FOR_FILL_ENV = constants.ENV_EARLY_READS_FOR_FILL
READ_JOBS_ENV = constants.ENV_EARLY_READ_JOBS
BESIDE_JOBS_ENV = constants.ENV_EARLY_READ_JOBS_BESIDE_FILL


def beside_fill() -> bool:
    """`WEIGHTCACHE_EARLY_READS_BESIDE_FILL`: 1 (default) lets the early reads go on beside the
    fill; 0 stops them when it begins (the earlier way, kept to compare). A bad value is the
    default: a knob that only tunes speed never fails a start."""
    return loadenv.flag(BESIDE_ENV, True)


def for_fill() -> bool:
    """`WEIGHTCACHE_EARLY_READS_FOR_FILL`: 1 has the early readers read a job the fill reaches
    first, for it; 0 (default) lets the fill read it itself. A bad value is the default."""
    return loadenv.flag(FOR_FILL_ENV, False)


def read_jobs() -> int:
    """`WEIGHTCACHE_EARLY_READ_JOBS`: consecutive jobs per read while the rank starts (1 to
    MAX_READ_JOBS, default READ_JOBS; more is MAX_READ_JOBS). A bad value is the default: a
    knob that only tunes speed never fails a start."""
    return min(loadenv.positive(READ_JOBS_ENV, READ_JOBS), MAX_READ_JOBS)


def beside_jobs() -> int:
    """`WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL`: consecutive jobs per read once the fill began
    (1 to MAX_READ_JOBS, default 1; more is MAX_READ_JOBS). A bad value is the default."""
    return min(loadenv.positive(BESIDE_JOBS_ENV, 1), MAX_READ_JOBS)


def span_of(chunk: int) -> int:
    """File bytes one read may cover so that its page-aligned extent fits in `chunk`."""
    return chunk - 2 * PAGE


def grid_span(read_span: int) -> int:
    """The bytes of one job over a whole file: whole content chunks, at most `read_span`."""
    return max(CHUNK_BYTES, read_span - read_span % CHUNK_BYTES)


def cover_spans(size: int, span: int) -> list[tuple[int, int]]:
    """The jobs [start, end) that read a whole file of `size` bytes on the chunk grid (one
    empty job for an empty file). The fill (`coldload._cover`) and the early reads cut files
    with this one function, so an early job is exactly a fill job."""
    return [(start, min(size, start + span)) for start in range(0, max(size, 1), span)]


def share_spans(size: int, span: int, chunks: set[int],
                own: set[int] | None = None) -> list[tuple[int, int]]:
    """The jobs [start, end) that read `chunks` of a file of `size` bytes: each maximal run of
    consecutive chunks, all in `own` or all outside it, cut into spans from its start. A
    tensor-parallel rank's fill (`coldload._cover`) and its early reads cut with this one
    function, with the same `own` (the chunks only this rank reads, tpshare.py): so a job is
    wholly the rank's own or wholly shared, and the early reads can take every own one."""
    runs: list[list[int]] = []  # [start, end, own] of each run, as byte ranges
    for index in sorted(chunks):
        lo, mine = index * CHUNK_BYTES, int(own is not None and index in own)
        if runs and runs[-1][1] == lo and runs[-1][2] == mine:
            runs[-1][1] = lo + CHUNK_BYTES
        else:
            runs.append([lo, lo + CHUNK_BYTES, mine])
    return [(start, min(size, start + span, hi))
            for lo, hi, _ in runs for start in range(lo, min(hi, max(size, 1)), span)]


def default_budget(local_ranks: int = 1) -> int:
    """`WEIGHTCACHE_LOAD_EARLY_MIB`, else a quarter of the memory this process may still take
    (the node's, capped by its container's limit: cgroups.py), shared by the node's ranks, at
    most MAX_BUDGET each."""
    text = os.environ.get(BUDGET_ENV, "").strip().lower()
    if text not in {"", "auto"}:
        return loadenv.whole_number(BUDGET_ENV, text, 0, "auto or a number of MiB") * MiB
    return min(MAX_BUDGET, (cgroups.available_memory() or 0) // (4 * max(1, local_ranks)))


@dataclass
class _Job:
    path: Path
    start: int
    end: int
    at: int  # offset of the job's first byte in its file's mapping (page-aligned)
    buf: mmap.mmap | None  # that mapping
    # 0 waiting, 1 reading, 2 done, 3 dropped, 4 the fill's (it reads it), 5 asked for by the
    # fill (an early reader reads it next)
    state: int = 0


class EarlyReads:
    """The first `budget` bytes of `files` (name order, each front to back) in host memory;
    for a tensor-parallel rank (`share`, `own`: tpshare.py), of the fill's jobs that only it
    reads."""

    def __init__(self, files: list[Path | str], budget: int, *, chunk: int | None = None,
                 threads: int | None = None, direct: bool | str = "auto",
                 disk: DiskShare | None = None, share: dict[Path, set[int]] | None = None,
                 own: dict[Path, set[int]] | None = None,
                 plan: Callable[[], tuple[dict[Path, set[int]], dict[Path, set[int]]]] | None
                 = None, ahead: dict[Path, int] | None = None) -> None:
        # The disk's share (diskshare.py): the early reads and then the fill yield to the
        # rank's own import and to any other program starting; close() stops it.
        self.disk = disk
        self.span = grid_span(span_of(chunk or loadenv.chunk()))  # the fill's jobs
        self.threads = max(1, threads or DEFAULT_THREADS)
        self.direct = direct if hasattr(os, "O_DIRECT") else False
        self._identities: dict[Path, FileIdentity] = {}
        self._fds: dict[Path, int] = {}
        self._jobs: dict[tuple[Path, int, int], _Job] = {}
        self._order: list[_Job] = []
        self._lock = threading.Condition()  # also signals a read that finished (`take`)
        self._refused: set[Path] = set()  # files the fill did not open as these very files
        self._stop = threading.Event()
        self._accepted = False  # the fill began (`accept`): normal priority, claims shared
        self.beside = beside_fill()  # go on beside the fill, or stop when it begins
        self.for_fill = for_fill()  # read the jobs the fill reaches first, for it
        self.read_jobs = read_jobs()  # jobs per read while the rank starts
        self.beside_jobs = beside_jobs()  # and once the fill began
        self._asked: deque[_Job] = deque()  # such jobs, read before any other
        self._reading = 0  # readers past their wait for `after` and not yet done
        self.asked_bytes = 0  # read for the fill, asked by it
        self.after_accept_bytes = 0  # read beside the fill
        self.claimed_bytes = 0  # jobs the fill claimed before any early read began them
        self._pool: Pool | None = None
        self._after: threading.Event | None = None
        self._wait_s = 0.0
        self.read_bytes = self.direct_bytes = self.taken_bytes = self.resident_bytes = 0
        self.idle_io = False
        self.started = self.seconds = 0.0
        self.waited: float | None = None  # seconds the first reader waited for `after`
        # When (time.monotonic(), one clock for every process of the node: READY's `marks`) the
        # first read was asked for and the first landed: the start's disk-idle time ends here.
        self.first_read_at: float | None = None
        self.first_landed_at: float | None = None
        # A tensor-parallel rank (tpshare.py): the fill reads `share`'s chunks of each file, in
        # jobs cut by share_spans; the early reads take those jobs made of `own` chunks only
        # (no other rank reads them), and open no file without one. `plan` computes the two
        # on the opener's thread (a large checkpoint's take a second of Python for TP 8: not
        # on the rank's main thread, which goes on to its import); `own` waits for it.
        self._share = None if share is None else {Path(p): c for p, c in share.items()}
        self._own = None if own is None else {Path(p): c for p, c in own.items()}
        self._plan = plan
        # The launcher's head start (headstart.py): per file, the end of what it asked the
        # disk for. Those jobs are the fill's (a copy from the page cache), never read here.
        self._ahead = {Path(p): end for p, end in (ahead or {}).items()}
        self.ahead_bytes = 0  # the bytes of such jobs
        self._planned = threading.Event()
        if plan is None:
            self._planned.set()
        self._unopened = deque(sorted(
            Path(p) for p in files if self._own is None or self._own.get(Path(p))))
        self._budget = budget  # asked for
        self.budget = 0  # the bytes of the jobs cut so far
        self._maps: list[mmap.mmap] = []  # one per file, for its jobs
        # The files are opened by one of the pool's threads, one after another, and each
        # file's jobs go to the readers as soon as it is open: on an H100 VM a rank's main
        # thread spent 36-96 ms opening 291 files before its `import torch` (a few of them,
        # the same in each run, blocked 11-41 ms each in `openat`; runs 54-59), and a
        # helper that opened them all before the first read delayed that read by as much.
        self._cutting = True  # files may still be opened and cut (not after `accept`)
        self._opened = threading.Event()  # the opener is done (or will never run)
        self._next = 0

    def _open_files(self) -> None:
        """Open the files in name order, each file's identity taken before its first read,
        and cut each one's jobs within the budget as soon as it is open. A file that cannot be
        opened or mapped is left to the fill (which says why); so is every file once the fill
        began (`accept`) or the reads stop. A tensor-parallel rank's `plan` comes first: a
        plan that fails (a rule that does not divide a tensor: the fill says so) reads
        nothing early."""
        try:
            self._make_plan()
            while True:
                with self._lock:
                    if (not self._unopened or not self._cutting or self._stop.is_set()
                            or self._budget - self.budget < 2 * PAGE):
                        return
                    path = self._unopened.popleft()
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    self._cut(path, fd, FileIdentity.of(os.fstat(fd)))
                except (OSError, ValueError):  # no memory for its jobs: the fill's
                    os.close(fd)
        finally:
            with self._lock:
                self._cutting = False
                self._lock.notify_all()  # readers waiting for jobs: there are no more
            self._opened.set()

    def _cut(self, path: Path, fd: int, ident: FileIdentity) -> None:
        """`path`'s jobs within what is left of the budget, in a mapping of its own, handed
        to the readers at once (or the file closed, if the fill began meanwhile)."""
        spans: list[tuple[int, int, int]] = []
        room, left = 0, self._budget - self.budget  # only the opener cuts
        asked = self._ahead.get(path, 0)
        for start, end in self._spans(path, ident.size):
            if end <= asked:
                self.ahead_bytes += end - start
                continue
            size = (end - start) + (-(end - start)) % PAGE + PAGE
            if room + size > left:
                break
            spans.append((start, end, room))
            room += size
        buf = mmap.mmap(-1, room, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if room else None
        if buf is not None and hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages: fewer faults
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        with self._lock:
            if not self._cutting or self._stop.is_set():
                os.close(fd)
                if buf is not None:
                    buf.close()
                return
            self._fds[path] = fd
            self._identities[path] = ident
            if buf is not None:
                self._maps.append(buf)
            for start, end, at in spans:
                job = _Job(path, start, end, at, buf)
                self._jobs[(path, start, end)] = job
                self._order.append(job)
            self.budget += room
            self._lock.notify_all()

    def _make_plan(self) -> None:
        if self._plan is None or self._planned.is_set():
            return
        try:
            try:
                share, own = self._plan()
            except Exception:  # the fill plans again and says what is wrong
                share, own = {}, {}
            with self._lock:
                self._share = {Path(p): c for p, c in share.items()}
                self._own = {Path(p): c for p, c in own.items() if c}
                self._unopened = deque(p for p in self._unopened if p in self._own)
        finally:
            self._planned.set()

    def _spans(self, path: Path, size: int) -> list[tuple[int, int]]:
        """The fill's jobs of `path` these reads may take: every one, or a tensor-parallel
        rank's jobs of its own chunks (share_spans cuts those apart from the shared ones)."""
        if self._share is None or self._own is None:
            return cover_spans(size, self.span)
        own = self._own.get(path, set())
        return [(start, end) for start, end in share_spans(size, self.span,
                                                           self._share.get(path, set()), own)
                if end > start and start // CHUNK_BYTES in own]

    @property
    def own(self) -> dict[Path, set[int]] | None:
        """A tensor-parallel rank's own chunks, per file: the fill cuts its jobs with them
        (once the opener made the plan; a stop before it leaves none)."""
        self._ready()
        self._planned.wait()
        return self._own

    def _ready(self) -> None:
        """Never started (a tool's or a test's use): the files are opened here, at once.
        Started, nothing waits for the opener: a job it has not cut yet is the fill's."""
        if self._pool is None and not self._opened.is_set():
            self._open_files()

    @property
    def identities(self) -> dict[Path, FileIdentity]:
        """Each file's identity, taken when it was opened, before its first early read;
        once the opener is done."""
        self._ready()
        self._opened.wait()
        return self._identities

    def start(self, after: threading.Event | None = None, wait_s: float = 0.0) -> EarlyReads:
        """Start reading; with `after`, only once it is set (at most `wait_s` later): the
        rank's own start reads its import set first (importset.py)."""
        self.started = time.perf_counter()
        self._after, self._wait_s = after, wait_s
        # Started by a helper: the rank's main thread goes on to its import at once. Kept
        # before it starts, so that `stop()` waits for it even if a signal interrupts `start`.
        # Thread 0 opens the files (first: the helper starts threads in order); the others
        # read. A pool whose gate closed before the opener ran still marks the files opened.
        self._pool = Pool(self._work, self.threads + 1, "early", daemon=True,
                          on_last=self._pool_ended)
        self._pool.start(background=True)
        return self

    def _pool_ended(self) -> None:
        self._planned.set()  # a plan never made (the pool stopped first) is no plan
        self._opened.set()

    def _claim(self, index: int) -> list[_Job]:
        """The next job to read, with the jobs that follow it in its file while the rank
        starts (module docstring); none when there is nothing left or the reads stop."""
        with self._lock:
            if self.direct is False and index >= BUFFERED_THREADS:
                return []
            while self._asked and not self._stop.is_set():
                job = self._asked.popleft()
                if job.state == 5:  # else the fill took it back (`take`)
                    job.state = 1
                    return [job]
            while True:
                while not self._stop.is_set() and self._next < len(self._order):
                    job = self._order[self._next]
                    self._next += 1
                    if job.state == 0:
                        job.state = 1
                        return self._follow(job)
                if not self._cutting or self._stop.is_set():
                    return []
                self._lock.wait()  # the opener's next file (or the end of the files)

    def _follow(self, job: _Job) -> list[_Job]:
        """`job` and the waiting jobs right after it in its file, `read_jobs` in all while the
        rank starts and `beside_jobs` once the fill began, where the reads are O_DIRECT and not
        gentle (under the lock). Each job but a file's last is whole pages, so the file range
        is one and each piece is aligned."""
        jobs = [job]
        count = self.beside_jobs if self._accepted else self.read_jobs
        if count <= 1 or self.direct is False or (self.disk is not None and self.disk.gentle):
            return jobs
        while len(jobs) < count and self._next < len(self._order):
            last, after = jobs[-1], self._order[self._next]
            if (after.state != 0 or after.path != last.path or after.start != last.end
                    or (last.end - last.start) % PAGE):
                break
            after.state = 1
            self._next += 1
            jobs.append(after)
        return jobs

    def _wait_after(self) -> None:
        """Until `after` is set, `stop()` is called or `wait_s` pass: a rank stopped while its
        import set is still read exits at once, not `wait_s` later (`stop` waits for the
        readers). Polled: `threading` cannot wait for either of two events."""
        assert self._after is not None
        deadline = time.monotonic() + self._wait_s
        while not self._after.is_set() and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._after.wait(min(left, STOP_POLL_S))

    def _work(self, thread: int) -> None:
        if thread == 0:
            self._open_files()
            return
        index = thread - 1  # the reader's
        direct_fds: dict[Path, int] = {}
        if idle_io_priority():
            self.idle_io = True
        if self._after is not None:
            t0 = time.perf_counter()
            self._wait_after()
            if index == 0:
                self.waited = round(time.perf_counter() - t0, 4)
        normal = False
        with self._lock:
            self._reading += 1
        try:
            while jobs := self._claim(index):
                if self._accepted and not normal:  # the start is over: read as the fill does
                    normal = True
                    if self.idle_io and not loadenv.idle():
                        normal_io_priority()
                done = 0
                if self.first_read_at is None:
                    self.first_read_at = time.monotonic()  # a race between readers moves it µs
                try:
                    done = self._read(jobs, direct_fds)
                finally:  # never left "reading": the fill may be waiting for it (`take`)
                    with self._lock:
                        for i, job in enumerate(jobs):
                            ok = i < done and job.path not in self._refused
                            job.state = 2 if ok else 3
                        self._lock.notify_all()
        finally:
            with self._lock:  # a job asked for now is the fill's (`take`)
                self._reading -= 1
                self._lock.notify_all()
            for fd in direct_fds.values():
                os.close(fd)

    def _read(self, jobs: list[_Job], direct_fds: dict[Path, int]) -> int:
        """Read `jobs` (consecutive in one file) with one call where it can; how many of them,
        from the first, were read whole."""
        first = jobs[0]
        base = self._fds[first.path]
        if self.direct == "auto" and resident(base, first.start, jobs[-1].end - first.start):
            with self._lock:
                self.resident_bytes += jobs[-1].end - first.start
            return 0  # the fill copies it from the page cache as fast as from here
        direct = self.direct is True or self.direct == "auto"
        try:
            if direct:
                fd = direct_fds.get(first.path)
                if fd is None and len(direct_fds) >= MAX_OPEN_PER_THREAD:
                    for other in direct_fds.values():  # thousands of files: bounded descriptors
                        os.close(other)
                    direct_fds.clear()
                if fd is None:
                    fd = direct_fds[first.path] = os.open(
                        f"/proc/self/fd/{base}", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
                views = [self._view(job, page=True) for job in jobs]
            else:
                fd, views = base, [self._view(job, page=False) for job in jobs]
            got = read_fully(fd, views, first.start, self.disk if direct else None)
        except OSError:
            if not direct:
                return 0
            self.direct = False  # the file system refuses O_DIRECT: buffered from now on
            try:
                got = read_fully(base, [self._view(job, page=False) for job in jobs],
                                 first.start)
            except OSError:
                return 0
        done = 0  # jobs read whole; a shorter file leaves the rest to the fill, which says so
        while done < len(jobs) and got >= jobs[done].end - first.start:
            done += 1
        n = sum(job.end - job.start for job in jobs[:done])
        if done:
            with self._lock:
                if self.first_landed_at is None:
                    self.first_landed_at = time.monotonic()
                self.read_bytes += n
                if direct:
                    self.direct_bytes += n
                if self._accepted:
                    self.after_accept_bytes += n
        return done

    def _view(self, job: _Job, page: bool) -> memoryview:
        """The job's place in its file's mapping; whole pages for O_DIRECT (`page`)."""
        assert job.buf is not None
        n = job.end - job.start
        return memoryview(job.buf)[job.at : job.at + n + ((-n) % PAGE if page else 0)]

    def join(self) -> None:
        """Wait until every job within the budget was read (a test's, or a tool's, wait)."""
        if self._pool is not None:
            self._pool.wait()

    def stop(self) -> dict[str, Any]:
        """No new reads; wait for those in flight. Idempotent (the figures of the first stop)."""
        first = not self._stop.is_set()
        self._stop.set()
        with self._lock:
            self._lock.notify_all()  # readers waiting for the opener's next file
        if self._pool is not None:
            try:
                self._pool.wait()
            except BaseException:  # a signal's: the reads in flight still end before it goes
                self._pool.close()
                raise
        if self.started and first and not self._accepted:
            self.seconds = time.perf_counter() - self.started
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "read_bytes": self.read_bytes,
                "direct_bytes": self.direct_bytes, "taken_bytes": self.taken_bytes,
                "resident_bytes": self.resident_bytes, "ahead_bytes": self.ahead_bytes,
                "idle_io": self.idle_io,
                "seconds": round(self.seconds, 3), "waited_seconds": self.waited,
                "after_accept_bytes": self.after_accept_bytes,
                "claimed_bytes": self.claimed_bytes, "asked_bytes": self.asked_bytes,
                "for_fill": self.for_fill, "beside_fill": self.beside,
                "read_jobs": self.read_jobs, "beside_jobs": self.beside_jobs,
                "first_read_at": self.first_read_at, "first_landed_at": self.first_landed_at}

    def accept(self, identities: dict[Path, FileIdentity]) -> None:
        """The fill starts: only the jobs of files it opened as the same, unchanged file are
        kept, and the early reads go on beside the fill, on the jobs that neither has begun
        (module docstring; with `beside_fill()` false, no new early read starts from now
        on, and those in flight land beside the fill); `seconds` is the time until now. A
        file the fill refused is read no further here. An empty `identities` (a fill that
        digests nothing) refuses every file: then nothing more is read early. No file is opened
        early from now on: the jobs the opener had not cut are the fill's."""
        self._ready()
        with self._lock:
            if not self._accepted and not self._stop.is_set() and self.started:
                self.seconds = time.perf_counter() - self.started
            self._accepted = True
            self._cutting = False
            if not self.beside:
                self._stop.set()  # no new early read; those in flight still land
            self._lock.notify_all()  # readers waiting for the opener's next file
            for path, ident in self._identities.items():
                if identities.get(path) != ident:
                    self._refused.add(path)
            for job in self._order:
                if job.state in (0, 2) and job.path in self._refused:
                    job.state = 3

    def holds(self, path: Path, start: int, end: int) -> bool:
        """Read already, or being read (`take` waits for it)."""
        self._ready()
        with self._lock:
            job = self._jobs.get((path, start, end))
            return job is not None and job.state in (1, 2) and path not in self._refused

    def _serving_fill(self) -> bool:
        """Whether a reader will read a job the fill asks for (under the lock). Not where the
        file system refuses O_DIRECT: then only BUFFERED_THREADS read early, fewer than the
        fill's readers."""
        return (self.for_fill and self.direct is not False and self._reading > 0
                and not self._stop.is_set())

    def take(self, path: Path, start: int, end: int) -> np.ndarray | None:
        """The bytes [start, end) of `path`, once; None if they were not read, and then the
        job is the caller's: no early read begins it any more (the fill reads it). A read
        still in flight is waited for: it is already at the disk, and the fill's own would
        queue behind it. A job no read began is read next by an early reader while any
        reads (module docstring), and waited for like one in flight; once none reads (all
        done, or stopped), it is the caller's."""
        with self._lock:
            job = self._jobs.get((path, start, end))
            if job is not None and job.state == 0:
                if not self._serving_fill():
                    job.state = 4
                    self.claimed_bytes += end - start
                    return None
                job.state = 5
                self._asked.append(job)
                self.asked_bytes += end - start
            while job is not None and job.state in (1, 5):
                if job.state == 5 and not self._serving_fill():
                    job.state = 4  # nobody reads any more: the fill's own
                    self.asked_bytes -= end - start
                    self.claimed_bytes += end - start
                    return None
                self._lock.wait()
            if job is None or job.state != 2 or job.buf is None:
                return None
            job.state = 3
            self.taken_bytes += end - start
        import numpy as np

        return np.frombuffer(job.buf, dtype=np.uint8, count=end - start, offset=job.at)

    def close(self) -> None:
        """Stop, and give the memory and the descriptors back (views from `take` must be gone)."""
        self.stop()
        if self.disk is not None:
            self.disk.stop()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for buf in self._maps:
            # A view still alive somewhere: the mapping goes with the last reference.
            with contextlib.suppress(BufferError):
                buf.close()
        self._maps.clear()


def read_fully(fd: int, views: memoryview | list[memoryview], offset: int,
               disk: DiskShare | None = None) -> int:
    """Bytes read into `views` (one after another, as the file's bytes from `offset` are):
    all of them, or fewer only at the end of the file. With `disk`, in the pieces and at the
    pace its share allows (whole pages: O_DIRECT, where each view is whole pages but the
    last)."""
    views = views if isinstance(views, list) else [views]
    got = 0
    total = sum(len(view) for view in views)
    while got < total:
        if disk is None:
            n = os.preadv(fd, _pieces(views, got, total - got), offset + got)
        else:
            allowed = disk.acquire(total - got)
            try:
                n = os.preadv(fd, _pieces(views, got, allowed), offset + got)
            finally:
                disk.release()
        if n == 0:
            break
        got += n
    return got


def _pieces(views: list[memoryview], start: int, count: int) -> list[memoryview]:
    """The bytes [start, start + count) of `views` taken as one run, as slices of them."""
    out: list[memoryview] = []
    for view in views:
        if count <= 0:
            break
        if start >= len(view):
            start -= len(view)
            continue
        take = min(count, len(view) - start)
        out.append(view[start : start + take])
        count -= take
        start = 0
    return out
