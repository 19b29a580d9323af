"""Share the disk with programs that are starting: a load's reads go gentle while they fault.

Why: a load keeps 32 reads of 16 MiB in flight, which is what the disk needs to run at its
rate, and every other read then waits behind half a gigabyte. A program that is starting
reads its libraries one page fault at a time, so it waits that long at each fault. Measured on
the H200 machine's virtual disk (tests/gpu/probe_io.py, docs/performance.md), a cold
`import torch` took:
- 3.8-4.6 s alone;
- over 30 s beside 32, 8 or 4 reads of 16 MiB, even at the idle I/O priority (the device
  queue holds them all, so the scheduler has nothing to reorder);
- 5.5 s beside 2 reads of 1 MiB at the idle priority, which still read 1.18 GB/s (1.94 GB/s
  with 32 x 16 MiB alone).

On a node that is new to a model, the engine starts beside the loading daemon. A rank's own
`import torch` runs beside its early reads. Both are such programs: yielding costs the load
about a third of the disk's rate for those seconds and gives the program its own pace back.

How the load knows: `/proc/vmstat` counts major page faults system-wide (`pgmajfault`),
including faults from other containers, since the counter is not namespaced. A load never
faults: it reads with `preadv` into memory it holds. So faults mean a program is paging code
or data in from storage. Swap-ins are faults too, and are subtracted (`pswpin`). At least
FAULTS faults within WINDOW seconds make the load gentle: at most GENTLE_READERS direct reads
in flight, each of at most GENTLE_READ bytes, at the idle I/O priority. It stays gentle until
HOLD seconds pass after the last fault of such a window; after another program's fault, for
as long as that program has been faulting, up to HOLD_MAX (an engine starting beside the load
reads files between its faults). (Counted from the window's end, it
was WINDOW + HOLD: on the H200, 4 faults of a short-lived program that nobody could name made
a cold READY gentle for 1.5-1.8 s, against the disk's full rate for 1 s of it. A program that
is still starting faults again within milliseconds once the reads are gentle, and one stalled
behind full reads within 0.3 s: either keeps the share gentle.) A reader that starts with
`read()` calls and no faults (Python source files, for one) shows in the disk's reads
instead (`pgpgin` of /proc/vmstat, less this process's `read_bytes` of /proc/self/io, both
counted where a read is sent to the device): a little of them beside a much larger load of
its own counts as one more fault of another program, while reads as large as its own
(another cache's load) never do (READ_SHARE). `WEIGHTCACHE_LOAD_YIELD_READS=0` turns that
look off.

A load's own faults are not another program starting. The counter is system-wide, and the
process that loads faults too: CUDA loads a kernel's code lazily, on first launch, from
libraries of hundreds of MB, and a reader's first copy faults those pages in. On the H200 the
in-process loader, alone on the machine, went gentle for 1.5-2.9 s of a 10 s cold load with
7 faults in its busiest window. So a share subtracts the faults of its own process
(`/proc/self/stat`, majflt) once that process is no longer starting: from the first moment
for a load inside a running program (`for_load`), from `ignore_own()` for a rank, whose
`import torch` beside its early reads is the very program the share yields to, until its device
is open. The share's stats say which faults it saw (`faults`, `own_faults`). A rank's
launcher is part of the same start, so a rank counts its launcher's faults as its own
(`count_as_own`). (On the H200, with every cache dropped, 4 faults of another process just as
the fill began made it gentle for 1.4 s; whose they were is not known yet, so `fault_times`
names the launcher's, and, for a sample with others' faults, the processes this share can see
in `/proc` whose fault count grew since the last look: `comm:pid:faults`, at most WHO of them.
That look is a walk of `/proc` (a few ms), made once when the share starts and then only when
others fault, at most LOOKS times. A process that faulted and exited in between, or one in
another PID namespace, is not named.)

A process's own children are part of it too (a rank used to start `/sbin/ldconfig -p` at
import, libc.py). So the faults of this process's descendants count as its own: those it has
reaped (`cmajflt` of its stat, and of its kin's), and live ones, found by the look at `/proc`
that others' faults trigger (their parent chain leads here) and read at every sample from
then on. Its kin's other children are not: a rank's launcher starts the node's other ranks,
whose imports the share must still yield to. (On the H200 the 3-4 faults that made cold fills
gentle were named `ld-linux-x86-64`, a short-lived program that was no descendant of the
rank: the machine's, yielded to as any other. On an H100 VM a probe found it: the test
machine's own `nvidia-smi` queries, run through its glibc loader by its PID 1.)

A rank that read its import set whole (importset.py) settles its share (`settle()`): the
faults seen until then were of pages now in the page cache, so they are forgotten; a fault
after that makes the reads gentle again. A span of gentle reads from the start (`start_gentle`)
runs its course even so. A rank gives its share START_GENTLE only where it has no import set
to settle it (a node's first start: the libraries are likely cold, and a fault already queued
behind a full rate of reads waits 0.3 s and more); a rank with one starts with none. Why: with
the half second kept after a settle, `import torch` (its libraries in memory, no fault seen)
ran 1 s faster on an H200 VM (run49: the rank's start 3.44-3.89 s against 4.53-4.85 without),
0.2 s on an H100 VM (run50: 2.81-2.87 against 3.06), but READY never gained: the same on
run49's disk (the reads made up for the slower import), 0.45-0.6 s later on run50's (7.53 /
7.57 / 7.73 s against 7.09 / 7.11). `WEIGHTCACHE_LOAD_START_GENTLE_S` sets the span for every
rank, for an A/B or for a machine whose disk reads a checkpoint faster than torch imports,
where READY would wait for the import.
A rank whose early reads start beside that read (`WEIGHTCACHE_EARLY_READS_WAIT=0`) holds its
share gentle until then (`hold_gentle()`): the read is plain `read()` calls, which fault
nothing, yet it is the start's own disk work.

Correctness does not depend on any of this: it changes only how many bytes are in flight and
when. `WEIGHTCACHE_LOAD_YIELD=off` turns it off (loadenv.py). Where `/proc/vmstat` cannot be
read, the load never goes gentle.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from collections import deque
from typing import Any

from . import loadenv

MiB = 1 << 20
INTERVAL = 0.05  # seconds between samples of /proc/vmstat
WINDOW = 0.5
# One fault is enough. The counter moves when a fault starts, before its wait, and a program
# stalled behind the full queue faults only every 0.3 s or so: on the H200, a threshold of 2
# per window let a rank's import crawl beside full-rate reads for 5 s.
FAULTS = 1
HOLD = 1.0  # the least hold after a fault (`WEIGHTCACHE_LOAD_HOLD_S`, for an A/B)
# Another program that keeps faulting is starting, not passing by: the hold after its last
# fault grows with the span of its faults so far (its episode: faults at most HOLD_MAX apart),
# from HOLD to HOLD_MAX. Why: an engine's `import transformers` reads thousands of Python files
# with `read()`, which fault nothing, between the faults of the libraries it maps; with a hold
# of HOLD the reads went full in those gaps, and each of its reads then waited behind the
# load's queue (on an H100 VM its imports took 14.3 s beside a cold load against 9.7 s alone,
# run68). A blip (a helper's 3-4 faults at once) still holds HOLD.
HOLD_MAX = 3.0
# Another program reading files with `read()` faults nothing, so its reads are seen apart from
# the faults: the disk's reads system-wide (`pgpgin` of /proc/vmstat, counted where a read is
# sent to the device) less this process's (`read_bytes` of /proc/self/io, counted at the same
# place). At least READ_FLOOR of them within WINDOW, and at most READ_SHARE of this process's
# own reads in it, count as one more fault of another program (measured from each of the
# window's first two samples, the lesser: `_others_reading`). A program starting reads little
# and slowly behind a full queue (a read of 128 KiB each 0.2 s or so); another bulk load on the
# node (another cache's rank, an image's layers) reads as much as this one and is not a program
# to yield to: two loads that counted each other would hold each other gentle.
READ_FLOOR = 256 * 1024
READ_SHARE = 0.25
SELF_IO = "/proc/self/io"
# The early reads of a rank with no import set start gentle: its `import torch` faults from
# its first milliseconds if the libraries are cold, and a fault already queued behind 32 x 16
# MiB waits 0.3 s. They go full after this long without a fault (libraries in the page cache).
# A rank with an import set starts with none (module docstring; run50).
START_GENTLE = 0.5
GENTLE_READERS = 2
GENTLE_READ = 1 * MiB
VMSTAT = "/proc/vmstat"
SELF_STAT = "/proc/self/stat"
PROC = "/proc"  # where the processes are looked at (`faults_by_process`)
TIMELINE = 32
WHO = 4  # processes named per sample with others' faults
LOOKS = 32  # walks of /proc per share, only when others fault (a few ms each; tens on a
# node whose /proc shows thousands of processes)
_KIN: list[str] = []  # stat files of processes whose faults count as this one's (count_as_own)
_KIN_IO: list[str] = []  # io files of processes whose reads count as this one's


def count_as_own(pid: int, reads: bool = False) -> None:
    """From now on, every share of this process counts `pid`'s major faults as its own (a
    rank's launcher: the same start, never another program to yield to); with `reads`, its
    disk reads too (`read_bytes` of `/proc/<pid>/io`: a child that reads the rank's import
    set, importset.Prefetch, until it is reaped, when the kernel adds them to this
    process's own)."""
    path = f"/proc/{pid}/stat"
    if path not in _KIN:
        _KIN.append(path)
    io = f"/proc/{pid}/io"
    if reads and io not in _KIN_IO:
        _KIN_IO.append(io)


def forget_own(pid: int) -> None:
    """Shares made from now on no longer count `pid` (reaped: its pid may be reused)."""
    for kin, path in ((_KIN, f"/proc/{pid}/stat"), (_KIN_IO, f"/proc/{pid}/io")):
        if path in kin:
            kin.remove(path)


def _descends(pid: int, ancestor: int, procs: dict[int, tuple[str, int, int]]) -> bool:
    """Whether `pid`'s parent chain in `procs` (pid -> (comm, faults, parent)) reaches
    `ancestor` (at most 32 links: a chain never loops, but a look at /proc is not atomic)."""
    for _ in range(32):
        found = procs.get(pid)
        if found is None or found[2] <= 1:
            return False
        pid = found[2]
        if pid == ancestor:
            return True
    return False


def _pid(stat_path: str) -> int:
    """The pid of a `/proc/<pid>/stat` path (count_as_own's); -1 for any other path."""
    part = stat_path.split("/")[2] if stat_path.startswith("/proc/") else ""
    return int(part) if part.isdigit() else -1


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}.get(platform.machine())
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread only
_io = threading.local()  # whether this thread's reads are at the idle class now


def _ioprio(value: int) -> bool:
    if _IOPRIO_SET is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, threading.get_native_id(),
                            value) == 0
    except (OSError, AttributeError):
        return False


def idle_io_priority() -> bool:
    """Put the calling thread's disk reads behind everyone else's (`ioprio_set(2)`, honoured
    by the mq-deadline and BFQ schedulers); False where refused."""
    ok = _ioprio(_IOPRIO_CLASS_IDLE << 13)
    if ok:
        _io.idle = True
    return ok


def normal_io_priority() -> bool:
    """The calling thread's reads back at the default class (the one its CPU nice implies)."""
    ok = _ioprio(0)
    if ok:
        _io.idle = False
    return ok


def thread_is_idle() -> bool:
    return getattr(_io, "idle", False)



def _vmstat(path: str) -> tuple[int | None, int | None]:
    """(major faults less swap-ins, bytes sent to block devices to be read) so far,
    system-wide, from one read of `path`; None for what is missing or unreadable."""
    faults = swapins = pgpgin = None
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(b"pgmajfault "):
                    faults = int(line.split()[1])
                elif line.startswith(b"pswpin "):
                    swapins = int(line.split()[1])
                elif line.startswith(b"pgpgin "):
                    pgpgin = int(line.split()[1]) * 1024  # KiB
    except (OSError, ValueError):
        return None, None
    return (faults - (swapins or 0) if faults is not None else None), pgpgin


def read_faults(path: str = VMSTAT) -> int | None:
    """Major page faults so far, system-wide, less swap-ins; None where unreadable."""
    return _vmstat(path)[0]


def read_disk_reads(path: str = VMSTAT) -> int | None:
    """Bytes sent to block devices to be read so far, system-wide (`pgpgin`); None where
    unreadable."""
    return _vmstat(path)[1]


def read_own_reads(path: str = SELF_IO) -> int | None:
    """Bytes this process (all its threads) sent to block devices to be read so far
    (`read_bytes` of proc_pid_io(5)); None where unreadable."""
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _stat_fields(text: bytes) -> tuple[str, list[bytes]]:
    """(command name, the fields after it) of a proc_pid_stat(5) line, whose command name
    may hold spaces and parentheses."""
    close = text.rindex(b")")
    return text[text.index(b"(") + 1 : close].decode(errors="replace"), text[close + 2 :].split()


def faults_by_process(proc: str = PROC) -> dict[int, tuple[str, int, int]]:
    """pid -> (command name, major faults so far, parent pid) of every process this one can
    see in `proc`."""
    out: dict[int, tuple[str, int, int]] = {}
    try:
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return out
    for name in entries:
        try:
            with open(f"{proc}/{name}/stat", "rb") as fh:
                comm, fields = _stat_fields(fh.read())
            out[int(name)] = (comm, int(fields[9]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def read_own_faults(path: str = SELF_STAT, children: bool = False) -> int | None:
    """This process's major page faults so far (all its threads; with `children`, also those
    of the children it has reaped); None where unreadable."""
    try:
        with open(path, "rb") as fh:
            text = fh.read()
        # majflt and cmajflt are fields 12 and 13 of proc_pid_stat(5), the 10th and 11th
        # after the command name.
        fields = _stat_fields(text)[1]
        return int(fields[9]) + (int(fields[10]) if children else 0)
    except (OSError, ValueError, IndexError):
        return None


class DiskShare:
    """One load's (one process's) share of the disk: full, or gentle while programs fault.

    `acquire(want)` gives a reader the bytes it may read now (all of them unless gentle),
    waiting while the gentle readers are all busy, and `release()` gives the slot back; the
    monitor thread decides full or gentle from the fault counter. `stop()` ends the monitor,
    and reads are full from then on.
    """

    def __init__(self, *, interval: float = INTERVAL, window: float = WINDOW,
                 faults: int = FAULTS, hold: float = HOLD, hold_max: float | None = None,
                 readers: int = GENTLE_READERS,
                 read: int = GENTLE_READ, source: str = VMSTAT,
                 start_gentle: float = 0.0, own: bool = True,
                 own_source: str = SELF_STAT, kin: tuple[str, ...] | None = None,
                 proc: str = PROC, reads: bool = True, io_source: str = SELF_IO) -> None:
        self.interval, self.window, self.faults, self.hold = interval, window, faults, hold
        # How long others' faults may hold it (module doc: HOLD_MAX); None: `hold` always.
        self.hold_max = max(hold, hold_max) if hold_max is not None else hold
        self.longest_hold = 0.0  # the longest hold others' faults were given (stats)
        # Others' reads count too (READ_FLOOR), where both counters can be read.
        counts = _vmstat(source)  # one read: a test's source may be a FIFO
        self.io_source = io_source
        self.reads = (reads and counts[1] is not None
                      and read_own_reads(io_source) is not None)
        self.read_events = 0  # samples where others' reads counted as a fault
        self.others_read = 0  # bytes others read while it watched (system-wide, less own)
        self.readers, self.read = max(1, readers), max(4096, read - read % 4096)
        self.source = source
        self.start_gentle = start_gentle  # gentle from start() until this long without faults
        self.own_source = own_source
        # Where other processes and this one's descendants are looked for: with counters read
        # from elsewhere (a test's), the processes must come from there too, or a real child's
        # faults would be added to counts that are not its.
        self.proc = proc
        self.kin = tuple(_KIN) if kin is None else kin  # counted as own (count_as_own)
        # Whose reads count as its own (count_as_own), where its own are this process's (a
        # test's source stands alone).
        self.kin_io = tuple(_KIN_IO) if io_source == SELF_IO else ()
        self._kin_last = dict.fromkeys(self.kin, 0)  # a process gone keeps its last count
        self._count_own = own  # False: this process's own faults are subtracted (module doc)
        self.available = counts[0] is not None
        self._cond = threading.Condition()
        self._busy = 0
        self._gentle = False
        self._since = 0.0
        self._stop = threading.Event()
        self._settled = 0  # settle() calls; the monitor forgets what it saw before each
        self._held = False  # gentle whatever the faults say, until settle() or let_go()
        self.settled_at: float | None = None  # seconds from start() to the first settle()
        self._began = time.monotonic()  # start() sets it anew: its clock counts from there
        self._thread: threading.Thread | None = None
        # Set once the monitor has read the counts it counts from (and looked at `proc`): a
        # fault before that is part of its baseline, never seen as one.
        self.watching = threading.Event()
        self._local = threading.local()
        self._named: list[str] = []  # the last `_who`'s answer
        self._family: set[int] = set()  # live descendants found by `_who`
        self._looks = 0
        self.gentle_seconds = 0.0
        self.switches = 0
        self.seen_faults = 0
        self.faults_total = 0  # seen while it watched: system-wide, and this process's
        self.own_total = 0
        # When they came: [seconds since start(), others', own (its kin's included), its kin's]
        # per sample that saw any, the first TIMELINE of them (where a start's faults fall
        # against its phases, and whether its launcher made them).
        self.timeline: list[list[float]] = []

    # -- the monitor ----------------------------------------------------------------------
    def start(self) -> DiskShare:
        self._began = time.monotonic()
        if self.available and self._thread is None:
            if self.start_gentle > 0:
                self._set(True, time.monotonic())
            self._thread = threading.Thread(target=self._watch, name="diskshare", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._set(False, time.monotonic())
        return self.stats()

    def hold_gentle(self) -> None:
        """Gentle from now until `settle()` or `let_go()`, faults or none: a rank's early
        reads beside the read of its import set, which faults nothing (plain `read()` calls)
        yet is the start's own disk work."""
        with self._cond:
            self._held = True
        self._set(True, time.monotonic())

    def let_go(self) -> None:
        """End `hold_gentle()` without settling: the faults decide again, as at any time."""
        with self._cond:
            self._held = False

    def settle(self) -> None:
        """The pages whose faults made it gentle are in memory now (the rank's import set was
        read whole, importset.py): forget those faults, so the reads go full once the start's
        gentle span is over (module docstring), at once after it. Any fault from now on makes
        it gentle again, as before."""
        now = time.monotonic()
        with self._cond:
            self._held = False
            self._settled += 1
            if self.settled_at is None:
                self.settled_at = round(now - self._began, 3)
        self._set(now < self._span_end(), now)

    def _span_end(self) -> float:
        """When the start's gentle span ends (time.monotonic(); the past without one)."""
        return self._began + self.start_gentle if self.start_gentle > 0 else -1e9

    def ignore_own(self) -> None:
        """From now on this process's own faults do not make the share gentle (its start is
        over: module docstring)."""
        self._count_own = False

    def _watch(self) -> None:
        # (when, faults, own faults, the disk's reads, own reads just before and after them)
        samples: deque[tuple[float, int, int, int | None, int | None, int | None]] = deque()
        reads_first: tuple[int | None, int | None] = (None, None)
        # Gentle until then: the start's span, and each counted fault's hold after it.
        until = self._span_end()
        episode: list[float] = []  # others' faults: [when the episode began, its last fault]
        first: tuple[int, int] | None = None
        began = time.monotonic()
        procs: dict[int, tuple[str, int, int]] = {}  # the last look: who had faulted how often
        settled = 0
        while not self._stop.is_set():
            with self._cond:
                if self._settled != settled:  # settle(): the faults before no longer count
                    settled = self._settled
                    samples.clear()
                    until, episode = self._span_end(), []
            now = time.monotonic()
            # This process's reads just before and just after the system's: its own reads
            # sent in between count as its own (`_others_reading` takes the bounds that make
            # others' reads the least), never as another program's.
            own_lo = self._own_reads() if self.reads else None
            count, disk_reads = _vmstat(self.source)
            if count is None:
                break
            own_hi = self._own_reads() if own_lo is not None else None
            if own_hi is None:
                disk_reads = None
            kin_before = sum(self._kin_last.values())
            own = self._own()
            kin_new = sum(self._kin_last.values()) - kin_before
            if first is None:
                first = (count, own)
                reads_first = (disk_reads, own_lo)
                procs = faults_by_process(self.proc)  # after the counts it starts from
                self.watching.set()
            named = None
            if (samples and count - samples[-1][1] > own - samples[-1][2]
                    and self._looks < LOOKS):  # another program's? name it, or find it ours
                procs, named = self._who(procs), self._named
                own = self._own()  # with the descendants it found, and the children reaped
            if samples and count != samples[-1][1] and len(self.timeline) < TIMELINE:
                mine = own - samples[-1][2]
                row: list[Any] = [round(now - began, 2), count - samples[-1][1] - mine, mine,
                                  kin_new]
                if named is not None and row[1] > 0:
                    row.append(named)
                self.timeline.append(row)
            self.faults_total, self.own_total = count - first[0], own - first[1]
            # Faults that count, new since the last sample: the hold runs from the last of them.
            mine = own - samples[-1][2] if samples else 0
            others = count - samples[-1][1] - mine > 0 if samples else False
            fresh = others or (self._count_own and mine > 0)
            samples.append((now, count, own, disk_reads, own_lo, own_hi))
            while len(samples) > 1 and samples[0][0] < now - self.window:
                samples.popleft()
            recent = count - samples[0][1]
            if not self._count_own:
                recent -= own - samples[0][2]
            reading = self._others_reading(samples, reads_first)  # as another's fault
            counted = recent >= self.faults
            if counted:
                if fresh or self.faults <= 0:  # a threshold of none: gentle throughout
                    until = max(until, now + self.hold)
                self.seen_faults = max(self.seen_faults, recent)
            if (counted and others) or reading:
                until = max(until, now + self._others_hold(episode, now))
            with self._cond:
                # A settle() since this sample's look began decided already. Applied over it,
                # this look's verdict (from faults the settle forgot) stood until the next
                # look, and a rank's `import torch`, holding the GIL for 0.2-0.4 s at a time,
                # put that off (run47-48).
                if self._settled == settled:
                    self._set(self._held or now < until, now)
            self._stop.wait(self.interval)

    def _own_reads(self) -> int | None:
        """This process's reads and its reading kin's (count_as_own). A child is reaped only
        once the load's share has stopped (rank.py): a reap moves its count from its own file
        to this process's, which a share running across it would see between two samples."""
        kin = sum(read_own_reads(path) or 0 for path in self.kin_io)
        own = read_own_reads(self.io_source)
        return None if own is None else own + kin

    def _others_reading(self, samples: deque, first: tuple[int | None, int | None]) -> bool:
        """Whether others' reads within the window count as another program's fault
        (READ_FLOOR), counted when someone else read since the last sample, so that the hold
        runs from their last read. This process's own reads (a rank's `import torch`, its
        import set's read) are never others': `read_bytes` counts them."""
        newest, oldest = samples[-1], samples[0]
        if None in (newest[3], oldest[3], first[0], first[1]) or len(samples) < 2:
            return False
        base = samples[1] if len(samples) > 2 else None  # the second base (below)

        def others(new: tuple, old: tuple) -> int:  # at least this much (a raced base: below)
            return (new[3] - old[3]) - (new[5] - old[4])

        self.others_read = max(0, (newest[3] - first[0]) - (newest[5] - first[1]))
        prev = samples[-2]
        if prev[3] is None or others(newest, prev) <= 0:
            return False  # nobody else read since the last sample
        # The kernel counts a read for the process, then for the system (`submit_bio`): a
        # base sample whose own count was read between the two holds a read of its own that
        # its system count lacks, and it would pass for another program's. The next sample as
        # the base does not hold the same read, so the lesser of the two counts; a window of
        # two samples (a monitor held up for longer than the window) has no second base and
        # counts nothing.
        if base is None or base[3] is None:
            return False
        theirs = min(others(newest, oldest), others(newest, base))
        own = newest[4] - oldest[5]
        if READ_FLOOR <= theirs <= READ_SHARE * own:
            self.read_events += 1
            return True
        return False

    def _others_hold(self, episode: list[float], now: float) -> float:
        """The hold after another program's fault at `now`: the span of its episode so far
        (`episode`, updated: a fault more than `hold_max` after the last begins a new one),
        at least `hold`, at most `hold_max` (module doc: HOLD_MAX)."""
        if not episode or now - episode[1] > self.hold_max:
            episode[:] = [now, now]
        episode[1] = now
        hold = min(self.hold_max, max(self.hold, now - episode[0]))
        self.longest_hold = max(self.longest_hold, hold)
        return hold

    def _who(self, before: dict[int, tuple[str, int, int]]) -> dict[int, tuple[str, int, int]]:
        """Look at /proc again: this process's live descendants join `_family` (their faults
        are its own from now on); `_named` = the other processes, not its kin either, whose
        major faults grew since `before` (most first, at most WHO); returns the new look."""
        self._looks += 1
        now = faults_by_process(self.proc)
        me = os.getpid()
        for pid in now:
            if pid not in self._family and _descends(pid, me, now):
                self._family.add(pid)
        mine = {me, *(_pid(path) for path in self.kin), *self._family}
        grew = sorted(((n - (before[pid][1] if pid in before else 0), comm, pid)
                       for pid, (comm, n, _) in now.items() if pid not in mine),
                      reverse=True)
        self._named = [f"{comm}:{pid}:{d}" for d, comm, pid in grew[:WHO] if d > 0]
        return now

    def _own(self) -> int:
        """This process's major faults and its reaped children's, its kin's (each kept at
        its last count once its process is gone, so that an exit never reads as others'
        faults), and its live descendants' (a descendant that is gone has been reaped: its
        faults are in its parent's count of reaped children now)."""
        total = read_own_faults(self.own_source, children=True) or 0
        for path in self.kin:
            count = read_own_faults(path, children=True)
            if count is not None:
                self._kin_last[path] = count
            total += self._kin_last[path]
        for pid in list(self._family):
            count = read_own_faults(f"{self.proc}/{pid}/stat")
            if count is None:
                self._family.discard(pid)
            else:
                total += count
        return total

    def _set(self, gentle: bool, now: float) -> None:
        with self._cond:
            if gentle == self._gentle:
                return
            if self._gentle:
                self.gentle_seconds += now - self._since
            else:
                self.switches += 1
            self._gentle, self._since = gentle, now
            self._cond.notify_all()

    @property
    def gentle(self) -> bool:
        return self._gentle

    # -- the readers ----------------------------------------------------------------------
    def acquire(self, want: int) -> int:
        """The bytes the caller may read now (all of `want` unless gentle); pair with release."""
        with self._cond:
            while self._gentle and self._busy >= self.readers:
                self._cond.wait(self.interval)
            gentle = self._gentle
            self._busy += 1
        self._priority(gentle)
        return min(want, self.read) if gentle else want

    def release(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify()

    def _priority(self, gentle: bool) -> None:
        """The idle I/O class while gentle; back to the default class when full, unless the
        thread was idle before (an early reader, `WEIGHTCACHE_LOAD_IO_PRIORITY=idle`)."""
        local = self._local
        raised = getattr(local, "raised", False)
        if gentle and not raised and not thread_is_idle():
            local.raised = idle_io_priority()
        elif not gentle and raised:
            normal_io_priority()
            local.raised = False

    def stats(self) -> dict[str, Any]:
        with self._cond:
            gentle = self.gentle_seconds + (time.monotonic() - self._since if self._gentle
                                            else 0.0)
        return {"available": self.available, "gentle_seconds": round(gentle, 3),
                "gentle_switches": self.switches, "most_faults_in_window": self.seen_faults,
                "faults": self.faults_total, "own_faults": self.own_total,
                "counts_own": self._count_own, "fault_times": list(self.timeline),
                "settled_at": self.settled_at, "start_gentle": self.start_gentle,
                "hold": self.hold, "hold_max": self.hold_max,
                "longest_hold": round(self.longest_hold, 3),
                "reads_seen": self.reads, "read_events": self.read_events,
                "others_read_bytes": self.others_read}


def for_load(disk: DiskShare | None = None, *, start_gentle: float = 0.0,
             own: bool = False) -> tuple[DiskShare | None, bool]:
    """The share a load uses: the one given (the caller started and stops it), else a new one
    when yielding is on (`WEIGHTCACHE_LOAD_YIELD`, loadenv.py) and the fault counter readable;
    (share, started here). `own`: count this process's faults too (a rank that is still
    starting; it calls `ignore_own` once its device is open)."""
    if disk is not None:
        return disk, False
    if not loadenv.yielding():
        return None, False
    mine = DiskShare(start_gentle=start_gentle, own=own, hold=loadenv.hold(HOLD),
                     hold_max=loadenv.hold_max(HOLD_MAX),
                     reads=loadenv.flag(loadenv.YIELD_READS_ENV, True))
    if not mine.available:
        return None, False
    return mine.start(), True
