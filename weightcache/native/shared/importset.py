"""What a rank's start reads from disk, kept from one start to read it ahead at the next
(torch-free).

On a node whose page cache is cold (a reboot, a new pod on a busy node) a rank's start is not
CPU work alone: `import torch` and the CUDA start fault in pieces of hundreds of shared
libraries and read thousands of bytecode files, a few KiB at a time, each waiting on the disk.
Beside the checkpoint's reads those small waits queue behind megabytes: measured on the H200
VM, the rank's start took 5.8-7.7 s with every cache dropped against 4.2-4.4 s with only the
model cold, and READY moved by as much. The early reads yield to page faults (diskshare.py),
but bytecode is read with `read()`, which no fault counter sees.

So after a start, the rank writes down its *import set* (`record`): the pages of every
file-backed mapping the page cache holds (`/proc/self/maps`, `mincore(2)` on the mapped
ranges), every module's bytecode file, and what the start opened for reading (files up to
OPENED_MAX_BYTES, whole) and the directories it listed or looked a missing file up in (`list`
entries), each file with its size and mtime_ns (not its
device and inode: a container's overlay file system gets a new device number at every start,
and a stale entry costs only a read). At the next start, before torch is imported,
`Prefetch` reads those ranges ahead, in file order, and the import then finds them in memory;
the opens come from an audit hook (`watch_opens`, installed by `start_prefetch`), because no
mapping or module shows them, yet on the H200 they were the longest wait of a cold start:
`import torch` reads every installed distribution's `entry_points.txt`, and each of those
opens waited 0.25-0.5 s behind the early reads (a 4 s longer start; runs 24-25 in
docs/performance.md);
the early reads begin at once, gentle until that is done or the set is found in memory but for
a small part (a restart; `Prefetch._check_then_read`; `early_reads_wait`). How it reads them
decides how long the disk does little else: on the H200 VM, 8 threads of one 4 MiB `pread` at a
time read a 465 MB set of 1,119 files in 1.43-1.68 s (0.3 GB/s, against 2 GB/s for the
checkpoint), most files being small and each one a few waits on the disk in turn. So the
default (`deep`) runs THREADS readers, asks the kernel's readahead for a file's every missing
range at once before it waits on them with `pread` (`POSIX_FADV_WILLNEED`, one call per
AHEAD_BYTES: the kernel reads at most its readahead window, `max(read_ahead_kb,
max_sectors_kb)`, per call, so one call for a whole range put only its first megabytes in
flight), and also looks up what the import reads besides the set's bytes, which `drop_caches`
empties too and no fault counter sees: each bytecode file's source (the import stats it to
validate the bytecode) and every directory it searches (listed once).
`WEIGHTCACHE_IMPORT_SET_PREFETCH=plain` reads the earlier way, to compare. A range the page
cache holds whole already is not read (`residency.resident`, one `cachestat(2)` or `mincore(2)`
call): where only the model is cold (a restart) the whole set is in memory, and reading it
anyway was 0.47-0.67 s of memory copies in front of the early reads (H200, run16). A file
whose size or mtime changed (an upgrade) is skipped; a file is only read, and its bytes go
nowhere but the page cache, so a wrong or stale list costs time, never correctness.

The set lives in the daemon user's cache directory (`$XDG_CACHE_HOME/weightcache`, else
`~/.cache/weightcache`) unless WEIGHTCACHE_IMPORT_SET names another file, or `off`. On
Kubernetes neither survives the agent pod, so the operator sets it to
`/var/lib/weightcache/daemon-state/<namespace>/<name>/import-set.json`, a host directory of
the cache's that outlives its pods (`constants.daemon_state_dir`, operator/resources.py). Not
the socket directory: engines mount that, and it holds sockets only. The set is written
atomically (a private temporary file, then rename) and read only if it is a regular file of
ours, not writable by others, at most MAX_SET_BYTES long; anything else is ignored.

A node's first start has no set of its own, and it is the start that needs one most: on an
H100 VM READY with every cache dropped took 13.8 s with no set against 9.7 s with one (run57),
slower than `from_pretrained` in a warm process (10.6 s), and a node new to a model is where an
engine waits for the cache (a scale-up). So the agent image carries a *seed*: the set of a start
recorded where the libraries were installed (`weightcache import-set record PATH`, run by
Dockerfile.agent, `WEIGHTCACHE_IMPORT_SET_SEED` naming it). The files of an image are the same
files on every node that runs it, with one difference from the build that recorded the seed:
an image's layers are tar archives whose entries keep a file's mtime to the whole second
(containerd's `archive/tar.go` and moby's `pkg/archive` both write
`hdr.ModTime = hdr.ModTime.Truncate(time.Second)`), so a node's copy of a file the build
wrote at 12:00:00.734 says 12:00:00.000. A seed therefore names each file by its size and its
mtime cut to the second (`"mtime_resolution_ns": 1000000000`, IMAGE_MTIME_NS), and its entries
are compared that way; a node's own set keeps the nanoseconds. Read with nanoseconds, every
entry of a seed for files that the build itself installed would have been skipped as changed
on every node. It is read
only where the node's own set is missing or untrusted, or was recorded under another seed: a
node's set names the seed's [size, mtime_ns] (`"seed"`), and after an agent upgrade it names
the old image's files, every one of which would be skipped as changed (a start as slow as one
with no set). The seed may be owned by root (the image's build), never writable by others;
the start then writes the node's own set all the same (`needs_record`), which adds what only a
node has (the driver's libraries, mounted at run time) and is read from then on. READY's
`import_prefetch.seeded` says a seed was read.

The rank imports torch once the set is read (`import_waits`, `WEIGHTCACHE_IMPORT_SET_WAIT`,
default 1; at most 3 s, rank.PREFETCH_WAIT_S). Beside the read, `import torch` holds the GIL
for up to 0.4 s at a time, and the readers need the GIL between their system calls: on H100
VMs with every cache dropped the read took 0.69-1.18 s beside the import, and the disk sat
idle for the last half second of it while the early reads waited for it (runs 75-77).
Measured in turn on one H100 VM (runs 78-80, 8 READYs a way over three layouts): with the
import after the set the early reads waited 0.09-0.17 s for it, against 0.21-0.29 s beside
it, and READY came sooner in all 6 pairs on `sharded` and `many` (0.31-0.80 s on average a
layout) and in 1 of 2 on `single` (0.05 s on average). The import starts later, but the early
reads start sooner, and READY waits on them. On a fresh node (run84, one pair) the engine's
first logits came 0.64 s sooner; most of the daemon's 1.6 s sooner READY there was the disk
share's gentle time, which the engine's own reads decide.
`WEIGHTCACHE_IMPORT_SET_PROCESS=1` (`reads_apart`, off by default) runs the census and a cold
read in a child process, forked before the rank has a second thread (`Prefetch._fork`). The
child dies with the rank, and its reads count as the rank's own for the disk share until it
is reaped (diskshare.count_as_own). A warm verdict hands the lacking files back to be read
here, beside the early reads, as before. It lost where it was measured: the early reads
waited 0.31-0.39 s for the set (the thread that hears the child's line needs the GIL that the
import holds), and on a fresh node the daemon was ready 0.9-1.6 s later and the engine's
first logits came 1.9-3.9 s later than with the set read in process (runs 81-83).

The prefetch is the first thing a rank process does (`python -m weightcache.native.daemon`
runs `start_prefetch` before it imports the rank's own modules): those modules, numpy among
their imports (60-200 ms of imports on a warm machine, longer from a cold disk), are in the set
too. So this module, and what it imports, stay free of numpy and torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import queue
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightcache import constants

from . import libc, loadenv
from .residency import resident, resident_pages
from .threads import Pool

PAGE = mmap.PAGESIZE
ENV = constants.ENV_IMPORT_SET  # a path, or "off"; default: SET_NAME in the user's cache
SET_NAME = constants.IMPORT_SET_NAME
WAIT_ENV = constants.ENV_IMPORT_SET_WAIT
PROCESS_ENV = constants.ENV_IMPORT_SET_PROCESS
EARLY_WAIT_ENV = constants.ENV_EARLY_READS_WAIT
PREFETCH_ENV = constants.ENV_IMPORT_SET_PREFETCH
THREADS_ENV = loadenv.IMPORT_SET_THREADS_ENV
WARM_ENV = constants.ENV_IMPORT_SET_WARM
SEED_ENV = constants.ENV_IMPORT_SET_SEED
OFF = {"off", "0", "false", "no"}
VERSION = 3  # 2: identities are [size, mtime_ns]; 3: what the start opened, and "list" entries
# A seed's mtimes, cut to the second as an image layer keeps them (module doc); a set without
# "mtime_resolution_ns" (a node's own) compares them to the nanosecond.
IMAGE_MTIME_NS = 1_000_000_000
MAX_SET_BYTES = 32 << 20  # the file itself
MAX_FILES = 20_000
MAX_BYTES = 4 << 30  # what one prefetch may read
MAX_SECONDS = 5.0  # and for how long (the early reads wait at most 3 s for it)
GAP = 256 << 10  # resident ranges closer than this are read as one
READ_BYTES = 4 << 20  # one read
DEEP_READ_BYTES = 1 << 20  # one read of a deep prefetch: a copy of pages already in flight
AHEAD_BYTES = 512 << 10  # one readahead request of a deep prefetch (module doc)
THREADS = 32  # readers of a deep prefetch (module doc; `prefetch_threads`)
MAX_THREADS = loadenv.MAX_IMPORT_SET_THREADS
OPENED_MAX_BYTES = 1 << 20  # a file the start opened is read ahead whole up to this size
PLAIN_THREADS = 8
# The check's verdict (`Prefetch._census`): a set whose page cache lacks at most this share of
# its bytes is *warm* (a restart: the libraries in memory, only the model cold), and the rank's
# early reads start at once instead of after its read; a cold node shows itself within
# COLD_FILES files, most of them with none of their pages in memory. (A restart has such files
# too, but few: on the H100 after an engine's start, some dozens of 1,474.)
# A third, not more: the one restart measured lacked 23% (130 of 554 MB); a node that lacks
# more may have evicted what the import needs, and its faults would wait behind full reads.
WARM_LACKING = 1 / 3
COLD_FILES = 32
CENSUS_THREADS = 16  # the census's lookers (`Prefetch._census`)
WARM_SAMPLE = 8  # the largest files `looks_warm` looks at
APART_MAX = 1 << 20  # the child's one line (`Prefetch._apart`): counts, or lacking files' indices

SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/", "/memfd:", "/run/")  # no disk behind them
_mincore = libc.function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


class _Opened:
    """What this process's start opens and lists by name (module doc: the files that neither
    a mapping nor a module shows), seen by an audit hook until the set is recorded."""

    paths: set[str] | None = None  # None: not watching
    dirs: set[str] = set()
    hooked = False
    quiet = threading.local()  # set in the prefetch's own readers: their opens are the set's


def _audit(event: str, args: tuple[Any, ...]) -> None:
    paths = _Opened.paths
    if (paths is None or len(paths) + len(_Opened.dirs) >= MAX_FILES
            or getattr(_Opened.quiet, "on", False)):
        return
    if event == "open":
        path, mode, flags = args
        if isinstance(path, str) and path.startswith("/") and (
                (mode is None and (flags or 0) & os.O_ACCMODE == os.O_RDONLY)
                or (isinstance(mode, str) and "r" in mode and "+" not in mode)):
            paths.add(path)
    elif (event in ("os.listdir", "os.scandir") and isinstance(args[0], str)
          and args[0].startswith("/")):
        _Opened.dirs.add(args[0])


def watch_opens() -> None:
    """Note what this process opens for reading and lists from now until `collect` (one audit
    hook per process; a hook cannot be removed, so afterwards it returns at once)."""
    if _Opened.paths is None:
        _Opened.paths = set()
        if not _Opened.hooked:
            _Opened.hooked = True
            sys.addaudithook(_audit)


def _opened() -> tuple[set[str], set[str]]:
    """What the start opened and listed, and stop watching."""
    paths, dirs = _Opened.paths or set(), set(_Opened.dirs)
    _Opened.paths, _Opened.dirs = None, set()
    return paths, dirs


def stop_watching() -> None:
    """The start is over and no set will be written (the one read still matched): what it
    opened is not needed, and a serving rank notes nothing more."""
    _opened()


def import_waits() -> bool:
    """`WEIGHTCACHE_IMPORT_SET_WAIT`: 1 (default) imports torch once the set is read (at most
    the early reads' wait), so that the readers never wait for the GIL the import holds and
    the import finds its pages in memory; 0 imports beside the read (module doc)."""
    return loadenv.flag(WAIT_ENV, True)


def reads_apart() -> bool:
    """`WEIGHTCACHE_IMPORT_SET_PROCESS`: 1 reads a cold set in a process of its own
    (`Prefetch.start`), 0 (default) in this one's threads."""
    return loadenv.flag(PROCESS_ENV, False)


def early_reads_wait() -> bool:
    """`WEIGHTCACHE_EARLY_READS_WAIT`: 0 (default) starts a rank's early reads at once, gentle
    (diskshare.py: two 1 MiB reads in flight) until its set is read or found in memory, so
    that the disk is not idle while the set is read from many small files; 1 starts them only
    then (the default until run96).

    Why 0, now that torch is imported once the set is read (`import_waits`): with every cache
    dropped, on one H100 VM, in turn with the default of then (runs 94 and 96, seven rounds),
    the early reads' first byte came 0.58-0.77 s after the launcher started against 0.76-0.98,
    the disk had read 0.08-0.75 GB more by the second second in six rounds of seven, the set's
    own read took no longer (0.45-0.61 s against 0.50-0.69), and READY came 0.39 s sooner on
    average, sooner in six rounds of seven. Beside an `import torch` that faulted the set's
    pages in itself (runs 17-19, before `import_waits`), it had been 0.1-0.5 s slower."""
    return loadenv.flag(EARLY_WAIT_ENV, False)


def warm_verdicts() -> bool:
    """`WEIGHTCACHE_IMPORT_SET_WARM`: 1 (default) lets a census that finds the set in memory
    but for a small part start the early reads at once (`Prefetch._check_then_read`); 0 reads
    the whole set first, as on a cold node (the earlier way, kept to compare)."""
    return loadenv.flag(WARM_ENV, True)


def deep_prefetch() -> bool:
    """`WEIGHTCACHE_IMPORT_SET_PREFETCH`: `deep` (default) or `plain` (module doc); anything
    else is the default."""
    return os.environ.get(PREFETCH_ENV, "").strip().lower() != "plain"


def prefetch_threads() -> int:
    """`WEIGHTCACHE_IMPORT_SET_THREADS`: a deep prefetch's readers, 1 to MAX_THREADS (default
    THREADS). Most of a cold set's files are small, so its read waits on the disk's latency
    with a few dozen requests in flight; more readers keep more in flight. A bad value is the
    default here (a rank refused it before: `loadenv.check`)."""
    return loadenv.import_set_threads(THREADS)


def set_path() -> Path | None:
    """Where this rank's import set lives; None when turned off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weightcache" / SET_NAME


def seed_path() -> Path | None:
    """`WEIGHTCACHE_IMPORT_SET_SEED`: the set a node's first start reads when the node has
    none of its own yet (module doc); None when unset."""
    value = os.environ.get(SEED_ENV, "").strip()
    return Path(value) if value and value.lower() not in OFF else None


def _identity(st: os.stat_result, whole_seconds: bool = False) -> list[int]:
    """What must still hold for an entry to be read: the same size, the same mtime (to the
    second for a seed's entry: module doc)."""
    mtime = st.st_mtime_ns
    return [st.st_size, mtime - mtime % IMAGE_MTIME_NS if whole_seconds else mtime]


def _coalesce(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """[start, end) ranges, sorted and merged across gaps shorter than GAP."""
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1] + GAP:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _mapped_ranges() -> dict[str, list[tuple[int, int]]]:
    """path -> the resident file ranges of this process' file-backed mappings."""
    import numpy as np  # here, not at the top: numpy's own files are in the set (module doc)

    found: dict[str, list[tuple[int, int]]] = {}
    if _mincore is None:
        return found
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith("(deleted)"):
            continue
        path = parts[5]
        if path.startswith(SKIP_PREFIXES):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        offset = int(parts[2], 16)
        length = hi - lo
        pages = length // PAGE
        if pages <= 0:
            continue
        vec = (ctypes.c_ubyte * pages)()
        if _mincore(lo, length, vec) != 0:
            continue
        bits = np.frombuffer(vec, dtype=np.uint8) & 1
        edges = np.flatnonzero(np.diff(np.concatenate(([0], bits, [0])).astype(np.int8)))
        ranges = found.setdefault(path, [])
        for first, last in zip(edges[0::2], edges[1::2], strict=True):  # resident page runs
            ranges.append((offset + int(first) * PAGE, offset + int(last) * PAGE))
    return found


def _module_files() -> set[str]:
    """The bytecode (or source, or extension) file of every module imported from a file."""
    files = set()
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        cached, source = getattr(spec, "cached", None), getattr(module, "__file__", None)
        for name in (cached, source):
            if isinstance(name, str) and name.startswith("/") and os.path.isfile(name):
                files.add(name)
                break
    return files


def collect(exclude: list[str | os.PathLike] = (), *, whole_seconds: bool = False
            ) -> dict[str, Any]:
    """This process' import set (see the module's docstring); `exclude`: files never listed
    (the checkpoint's: the fill reads those itself), nor anything the start opened or listed
    in their directories (the model's config and index, the socket directory): those are
    this model's, not the start's, and a set naming a file that is gone at the next start is
    stale, so it would be written anew, from a page cache that may hold far more.
    `whole_seconds`: a seed's identities (module doc)."""
    skip = {os.path.realpath(p) for p in exclude}
    skip_dirs = {os.path.dirname(p) for p in skip}
    entries: dict[str, dict[str, Any]] = {}
    for path, ranges in _mapped_ranges().items():
        if not ranges or os.path.realpath(path) in skip:
            continue
        try:
            st = os.stat(path)  # the identity a later start checks before reading
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        entries[path] = {"identity": _identity(st, whole_seconds),
                         "ranges": _coalesce(ranges)}
    for path in sorted(_module_files()):
        if path in entries or os.path.realpath(path) in skip:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size:
            entries[path] = {"identity": _identity(st, whole_seconds),
                             "ranges": [[0, st.st_size]]}
    opened, listed = _opened()
    for path in sorted(opened):
        real = os.path.realpath(path)
        if (path in entries or path.startswith(SKIP_PREFIXES)
                or os.path.dirname(real) in skip_dirs):  # an excluded file's, or beside one
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:  # looked for and missing: its directory is what was read
            listed.add(os.path.dirname(path))
            continue
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and 0 < st.st_size <= OPENED_MAX_BYTES:
            entries[path] = {"identity": _identity(st, whole_seconds),
                             "ranges": [[0, st.st_size]]}
    for path in sorted(listed):
        if (path not in entries and not path.startswith(SKIP_PREFIXES)
                and os.path.realpath(path) not in skip_dirs and os.path.isdir(path)):
            entries[path] = {"list": True}
    files = [{"path": p, **e} for p, e in sorted(entries.items())][:MAX_FILES]
    found: dict[str, Any] = {"version": VERSION, "files": files}
    if whole_seconds:
        found["mtime_resolution_ns"] = IMAGE_MTIME_NS
    found["bytes"] = sum(end - start for f in files for start, end in f.get("ranges", ()))
    return found


def record(path: Path, exclude: list[str | os.PathLike] = (), *, shared: bool = False,
           whole_seconds: bool = False) -> dict[str, Any] | None:
    """Write this process' import set to `path` (atomically, 0600; `shared`: 0644 in a
    directory others may enter, a seed that other users' ranks read; `whole_seconds`: mtimes
    to the second, as a seed for an image's files needs them); None if it cannot.

    Never naming itself: this start opened the set to read it, and a set that names the file
    it is written over is stale at once (its identity is the old file's), so every later start
    would write it anew, from whatever the page cache held then."""
    found = collect([*exclude, path], whole_seconds=whole_seconds)
    if not whole_seconds and (image := _seed_identity(seed_path())) is not None:
        found["seed"] = image  # which image's files this node's set names (start_prefetch)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o755 if shared else 0o700, parents=True, exist_ok=True)
        _forget_stale(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        if shared:
            os.fchmod(fd, 0o644)  # exactly, whatever the umask
        with os.fdopen(fd, "w") as fh:
            json.dump(found, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return found


def _forget_stale(path: Path) -> None:
    """Temporary files of writers that died before their rename (a rank stopped at once)."""
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 1 : -len(".tmp")]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _seed_identity(seed: Path | None) -> list[int] | None:
    """[size, mtime_ns] of the seed (`seed_path`), if it is a file: the image a node's set was
    recorded under (a new image carries a new seed)."""
    try:
        st = os.stat(seed) if seed is not None else None
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns] if st is not None and stat.S_ISREG(st.st_mode) else None


def start_prefetch() -> tuple[Path | None, Prefetch | None]:
    """(where the set lives, its prefetch of the files `chosen` names, started now); (None,
    None) when turned off. Never raises: a start must not fail over a read-ahead."""
    try:
        if set_path() is None:
            return None, None
        watch_opens()  # for this start's record, if it writes one
        _Opened.quiet.on = True  # the sets are not what the start reads
        try:
            found, files, seeded = chosen()
        finally:
            _Opened.quiet.on = False
        return found, Prefetch(files, seeded=seeded).start()
    except Exception:  # an unreadable home, a thread that cannot start: no read-ahead
        return None, None


def chosen() -> tuple[Path | None, list[dict[str, Any]], bool]:
    """(where the node's set lives, the files a start reads ahead, whether they are the
    seed's); (None, [], False) when turned off.

    The node's own set, else the image's seed. Also the seed where the node's set was recorded
    under another seed than the image has now: the agent was upgraded, and the set names the
    old image's files, every one of which would be skipped as changed, leaving the start as
    slow as a first start with no set."""
    found = set_path()
    if found is None:
        return None, [], False
    recorded: dict[str, Any] = {}
    files, seeded = load(found, meta=recorded), False
    seed = seed_path()
    image = _seed_identity(seed)
    upgraded = image is not None and recorded.get("seed") not in (None, image)
    # A node's first start (or a set we could not trust), or a set of another image's files
    # (an upgrade): the seed, written by root where the image was built, or by this user.
    # The node's set stays where no seed can be read.
    if ((not files or upgraded) and seed is not None
            and (seed_files := load(seed, owners=(os.getuid(), 0)))):
        files, seeded = seed_files, True
    return found, files, seeded


def looks_warm(files: list[dict[str, Any]], sample: int = WARM_SAMPLE) -> bool:
    """Whether the page cache holds the set's `sample` largest files but for at most
    WARM_LACKING of their bytes: the census's warm verdict (`Prefetch._census`) from a few
    looks, for a launcher that decides before its rank runs (headstart.py). A restart finds
    those in memory; a node whose page cache was dropped, or one new to the image, does not.
    An empty set is not warm: nothing says the libraries are in memory."""
    weighed = sorted(((sum(end - start for start, end in f["ranges"]), f) for f in files
                      if not f.get("list")), key=lambda pair: -pair[0])[:sample]
    total = lacked = 0
    for size, f in weighed:
        look = _look_at(f)
        total += size
        lacked += size if look is None else look[2] * PAGE
    return total > 0 and lacked <= WARM_LACKING * total


def load(path: Path, owners: tuple[int, ...] | None = None,
         meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The files of the import set at `path`; [] if there is none we can trust or parse:
    a regular file (not a link) owned by this user (or by one of `owners`), writable by no
    one else, at most MAX_SET_BYTES. `meta` receives the set's `seed` ([size, mtime_ns] of
    the seed it was recorded under), if it names one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid not in (owners or (os.getuid(),))
                or st.st_mode & 0o022 or st.st_size > MAX_SET_BYTES):
            return []
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = json.loads(fh.read(MAX_SET_BYTES + 1))
    except (OSError, ValueError):
        return []
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return []
    files, resolution = data.get("files"), data.get("mtime_resolution_ns", 1)
    if not isinstance(files, list) or resolution not in (1, IMAGE_MTIME_NS):
        return []
    whole_seconds = resolution == IMAGE_MTIME_NS
    image = data.get("seed")
    if (meta is not None and isinstance(image, list) and len(image) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in image)):
        meta["seed"] = image
    good = []
    for f in files[:MAX_FILES]:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            continue
        if f.get("list") is True:  # a directory the start looked a name up in
            good.append({"path": f["path"], "list": True})
            continue
        ident, ranges = f.get("identity"), f.get("ranges")
        if (not isinstance(ident, list) or len(ident) != 2
                or not all(isinstance(v, int) for v in ident) or not isinstance(ranges, list)):
            continue
        spans = [(r[0], r[1]) for r in ranges if isinstance(r, list) and len(r) == 2
                 and all(isinstance(v, int) for v in r) and 0 <= r[0] < r[1]]
        if spans:
            entry = {"path": f["path"], "identity": ident, "ranges": spans}
            if whole_seconds:
                entry["whole_seconds"] = True
            good.append(entry)
    return good


def ahead(fd: int, start: int, end: int) -> None:
    """Ask the kernel to read [start, end) of `fd` into the page cache, without waiting."""
    with contextlib.suppress(OSError):
        for pos in range(start, end, AHEAD_BYTES):
            os.posix_fadvise(fd, pos, min(AHEAD_BYTES, end - pos), os.POSIX_FADV_WILLNEED)


def _open_recorded(f: dict[str, Any]) -> tuple[int, list[tuple[int, int]]] | None:
    """A descriptor of the set's file `f` and its recorded ranges within its size, if it is
    still the regular file recorded (size and mtime, to the second for a seed's entry); None
    if not. The caller closes it."""
    try:
        fd = os.open(f["path"], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (stat.S_ISREG(st.st_mode)
                and _identity(st, f.get("whole_seconds", False)) == f["identity"]):
            return fd, [(start, min(end, st.st_size)) for start, end in f["ranges"]
                        if start < min(end, st.st_size)]
    except OSError:
        pass
    os.close(fd)
    return None


def _look_at(f: dict[str, Any]) -> tuple[int, int, int] | None:
    """(the bytes of the set's file `f`, its pages in memory, its pages missing) for the
    census; a directory entry that still is one counts as held (0, 0, 0); None for anything
    changed or gone (its read counts it unread)."""
    if f.get("list"):  # still there (one stat; listing it is the full read's)
        try:
            return (0, 0, 0) if stat.S_ISDIR(os.stat(f["path"]).st_mode) else None
        except OSError:
            return None
    opened = _open_recorded(f)
    if opened is None:
        return None
    fd, ranges = opened
    size = found = missing = 0
    try:
        for start, end in ranges:
            answer = resident_pages(fd, start, end - start)
            pages, pages_in = answer if answer is not None else (0, 1)  # can't say: lacking
            size += end - start
            found += pages
            missing += pages_in - pages
    finally:
        os.close(fd)
    return size, found, missing


class _Count:
    """The census's totals so far, and whether they say cold already (`Prefetch._census`;
    its lock guards them). `total`: the set's bytes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = self.lacked = self.empty = self.seen = 0
        self.lacking: list[dict[str, Any]] = []
        self.cold = False

    def add(self, f: dict[str, Any], look: tuple[int, int, int] | None) -> None:
        if look is None:  # changed, gone or no longer a directory: lacking, and not weighed
            self.lacking.append(f)
            return
        if f.get("list"):
            return
        size, found, missing = look
        self.seen += 1
        if not missing:
            self.held += size
            return
        self.lacking.append(f)
        self.lacked += missing * PAGE
        self.empty += found == 0
        if ((self.empty >= COLD_FILES and 2 * self.empty > self.seen)
                or self.lacked > WARM_LACKING * self.total):
            self.cold = True  # and stays so, whatever is counted after


class Prefetch:
    """Read an import set into the page cache (`prefetch_threads()` readers, or PLAIN_THREADS
    when not `deep`); `done` is set when it is read, or given up (MAX_BYTES, MAX_SECONDS,
    `stop`)."""

    def __init__(self, files: list[dict[str, Any]], deep: bool | None = None, *,
                 seeded: bool = False) -> None:
        self.files = files
        self.seeded = seeded  # the files are the seed's (`start_prefetch`), not this node's
        self.deep = deep_prefetch() if deep is None else deep
        self._dirs: set[str] = set()  # directories listed already (deep)
        self._looked_up = 0  # directories listed and sources looked up (deep)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._read = 0
        self._resident = 0  # bytes of the set the page cache held already: not read
        self._files_read = 0
        self._unread = 0
        self._started = 0.0
        self._seconds = 0.0
        self.import_waited: float | None = None  # seconds the import waited for it, if it did
        self.checked_only = False  # the whole set was resident: nothing read or looked up
        self.warm = False  # the check found the set in memory but for a small part (census)
        self._warm_at: float | None = None
        self._census_at: float | None = None  # when the census ended (time.monotonic())
        # Set once the early reads may start: on a warm verdict, else when done.
        self.early_go = threading.Event()
        self._on_done: list[Callable[[], None]] = []
        self._on_warm: list[Callable[[], None]] = []
        self._look = self.deep  # list directories and look sources up beside the reads
        self.child: int | None = None  # the process reading the set (`_fork`), until reaped
        self.apart = False  # read in a process of its own (stats)
        self.readers = 0  # threads that read it (`_read_all`; 0: nothing read on this side)

    def start(self, apart: bool | None = None) -> Prefetch:
        """Take the census and read what it says, on threads of this process; with `apart`
        (default: `reads_apart()`), in a process of its own (`_fork`)."""
        self._started = time.monotonic()
        if not self.files:
            self._finish()
            return self
        if (reads_apart() if apart is None else apart) and self._fork():
            return self
        threading.Thread(target=self._check_then_read, name="weightcache-prefetch-check",
                         daemon=True).start()
        return self

    def _check_then_read(self) -> None:
        """One thread first takes the set's census (`_census`); the reads follow from it.

        Where the whole set is in the page cache (a node whose agent ran before, with only the
        model cold), the prefetch is done once that thread has seen it. Where a small part is
        missing, the verdict is *warm*: the early reads start at once (`early_go`) and only
        the files lacking pages are read, without the look-ups. Else (a cold node) the whole
        set is read as below, and the early reads wait for it.

        The full read also lists directories and looks up bytecode sources (`deep`), in
        THREADS readers: with every page resident that was 0.2 s of Python on the H200 (692
        look-ups, 1,474 files), beside the rank's own imports and in front of its early reads.
        A file whose pages are in memory has its inode and name in memory too (the kernel
        drops a file's pages with its inode), so skipping the look-ups then skips nothing the
        import would wait on; a stale guess costs time, never bytes.

        Why a warm verdict at all: a set is recorded as the resident runs of the start's
        mappings, merged across gaps of up to GAP, and readahead made them; a later process
        that imports the same libraries (an engine, a start of ours) faults other pages in.
        So after a restart the set is rarely whole in memory: on the H100, with the model cold
        after an engine's start, 130 MB of a 554 MB set were missing, its read took 0.17-0.35 s
        and the checkpoint's first byte landed 0.6-0.75 s after the spawn instead of 0.3-0.45.
        The import needs few of those pages (it faulted the rest in already once); the ones
        it does need fault in beside the early reads, and the disk share goes gentle for
        them (diskshare.py), as for any program that starts."""
        _Opened.quiet.on = True
        self._after_census(self._take_census())

    def _take_census(self) -> tuple[int, list[dict[str, Any]]] | None:
        """`_census`, timed (`census_at`); None where it failed: the full read decides."""
        try:
            census = self._census()
        except Exception:
            census = None
        self._census_at = time.monotonic()
        return census

    @staticmethod
    def _cold(census: tuple[int, list[dict[str, Any]]]) -> bool:
        """Whether a census that found the set mostly in memory still asks for the full
        read: something lacks, and warm verdicts are off. (No census at all, None, is a cold
        node's: the callers read all then too.)"""
        return bool(census[1]) and not warm_verdicts()

    def _after_census(self, census: tuple[int, list[dict[str, Any]]] | None) -> None:
        """What the census's verdict asks for (`_check_then_read`): read all, read what is
        lacking after the warm verdict, or nothing."""
        try:
            if census is None or self._cold(census):
                self._read_all(self.files)
                return
            held, lacking = census
            with self._lock:
                self._resident = held
                self._files_read = len(self.files) - len(lacking)
                self.checked_only = not lacking
            if not lacking:
                self._end()
                return
            self._go_warm()
            self._look = False
            self._read_all(lacking)
        except Exception:  # no reader could start: done, with what was read
            self._end()

    def _census(self) -> tuple[int, list[dict[str, Any]]] | None:
        """(the bytes of the files held whole, the files lacking some page or changed) where
        the page cache lacks at most WARM_LACKING of the set's bytes; None at the first sign
        that it lacks more: that share passed, or COLD_FILES files or more with no page in
        memory making most of those seen (a cold node stops within a few dozen opens).

        CENSUS_THREADS look at the files side by side: a file whose pages the page cache
        dropped has often lost its inode too, and its open waits on the disk. One thread
        looking at them in turn took 1.14 s on the H100 (run43: a restart's set, 1,474 files),
        where the look itself is milliseconds."""
        count = _Count(sum(end - start for f in self.files for start, end in f.get("ranges", ())))
        lock = threading.Lock()
        files = iter(self.files)

        def worker(_: int) -> None:
            _Opened.quiet.on = True  # the census's opens are the set's, not the start's
            while True:
                with lock:
                    if count.cold or self._stop.is_set():
                        return
                    f = next(files, None)
                if f is None:
                    return
                look = _look_at(f)
                with lock:
                    count.add(f, look)

        Pool(worker, min(CENSUS_THREADS, len(self.files)), "weightcache-census",
             daemon=True).start().wait()
        if count.cold or self._stop.is_set():
            return None
        return count.held, count.lacking

    def _go_warm(self) -> None:
        """The warm verdict: the early reads may start, and the `when_warm` calls run."""
        with self._lock:
            self.warm, self._warm_at = True, time.monotonic()
            calls, self._on_warm = self._on_warm, []
        self.early_go.set()
        for call in calls:
            call()

    def when_warm(self, call: Callable[[], None]) -> None:
        """Call `call` on a warm verdict (at once if there was one; never if the prefetch
        ended without one): on the thread that reaches it."""
        with self._lock:
            if not self.warm:
                if not self.done.is_set():
                    self._on_warm.append(call)
                return
        call()

    def _read_all(self, files: list[dict[str, Any]]) -> None:
        work: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        for f in files:
            work.put(f)
        count = min(prefetch_threads() if self.deep else PLAIN_THREADS, len(files))
        self.readers = count
        for _ in range(count):
            work.put(None)

        def worker(_: int) -> None:
            _Opened.quiet.on = True
            buf = bytearray(DEEP_READ_BYTES if self.deep else READ_BYTES)
            while (f := work.get()) is not None:
                if self._stop.is_set() or self._over():
                    continue
                self._one(f, memoryview(buf))

        Pool(worker, count, "weightcache-prefetch", daemon=True, on_last=self._end).start()

    def _end(self) -> None:
        """Done now: how long it took, then `done` and the callbacks."""
        self._seconds = time.monotonic() - self._started
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            self.done.set()
            calls, self._on_done, self._on_warm = self._on_done, [], []
        self.early_go.set()
        for call in calls:
            call()

    def when_done(self, call: Callable[[], None]) -> None:
        """Call `call` once `done` is set (at once if it is): on the thread that sets it."""
        with self._lock:
            if not self.done.is_set():
                self._on_done.append(call)
                return
        call()

    def whole(self) -> bool:
        """Done, and every file of a non-empty set read as recorded: the pages the last
        start read are in the page cache now."""
        with self._lock:
            return (self.done.is_set() and bool(self.files) and self._unread == 0
                    and self._files_read == len(self.files))

    def _over(self) -> bool:
        return self._read >= MAX_BYTES or time.monotonic() - self._started > MAX_SECONDS

    def _one(self, f: dict[str, Any], buf: memoryview) -> None:
        if f.get("list"):
            self._list(f["path"])
            return
        opened = _open_recorded(f)
        if opened is None:
            self._count(unread=1)
            return
        fd, ranges = opened
        try:
            got = held = 0
            missing = []
            for pos, end in ranges:
                if resident(fd, pos, end - pos):
                    held += end - pos  # in memory already: nothing to read (module doc)
                    continue
                missing.append((pos, end))
                if self.deep:  # all of it in flight now; the reads below wait for it
                    ahead(fd, pos, end)
            if self._look:
                self._look_up(f["path"])
            for pos, end in missing:
                while pos < end and not self._stop.is_set():
                    n = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
                    if n <= 0:
                        break
                    pos += n
                    got += n
            self._count(read=got, files=1, held=held)
        except OSError:
            self._count(unread=1)
        finally:
            os.close(fd)

    def _list(self, path: str) -> None:
        """A directory of the set: its entries, as a lookup of a missing name reads them."""
        if self._list_new([path])[1]:
            self._count(unread=1)
        else:
            self._count(files=1)

    def _list_new(self, dirs: list[str]) -> tuple[int, int]:
        """List those of `dirs` this prefetch has not listed yet: (listed, failed)."""
        with self._lock:
            dirs = [d for d in dirs if d not in self._dirs]
            self._dirs.update(dirs)
        listed = 0
        for d in dirs:
            with contextlib.suppress(OSError):
                os.listdir(d)
                listed += 1
        with self._lock:
            self._looked_up += listed
        return listed, len(dirs) - listed

    def _look_up(self, path: str) -> None:
        """What the import reads besides this file's bytes (module doc): its directory's
        entries, and for a bytecode file its source's directory and the source itself."""
        parent = os.path.dirname(path)
        if os.path.basename(parent) != "__pycache__" or not path.endswith(".pyc"):
            self._list_new([parent])
            return
        top = os.path.dirname(parent)
        self._list_new([parent, top])
        with contextlib.suppress(OSError):
            os.stat(os.path.join(top, os.path.basename(path).split(".", 1)[0] + ".py"))
            with self._lock:
                self._looked_up += 1

    def _count(self, read: int = 0, files: int = 0, unread: int = 0, held: int = 0) -> None:
        with self._lock:
            self._read += read
            self._resident += held
            self._files_read += files
            self._unread += unread

    def stop(self) -> None:
        """Give up: no more reads; the reading process, if any, is killed (and reaped)."""
        self._stop.set()
        if self.child is not None:
            with contextlib.suppress(OSError):
                os.kill(self.child, signal.SIGKILL)
            self.close()

    # -- a cold set read in a process of its own ------------------------------------------
    def _fork(self) -> bool:
        """Read the set in a child process (`_apart`), whose threads never wait for this
        process's GIL; this process follows it (`_follow`). False (read here) where that
        cannot be: a fork copies only the calling thread, so it is never made while this
        process runs others (`start_prefetch` runs before any).

        Why: beside the rank's `import torch`, which holds the GIL in spans of 0.2-0.4 s, the
        set's readers, which need it between their system calls, took 0.69-1.18 s, the disk
        idle for the last half second of it while the early reads waited (H100 VMs, runs
        75-77); on CPU the read took twice as long beside the import as alone, and no longer
        than alone in a process of its own (tests/gpu/probe_prefetch_gil.py). The child takes
        the census too; where its verdict is warm it hands the files that lack pages back,
        and they are read here, beside the early reads, as before: the share counts this
        process's reads as its own, and a child's only once it is registered
        (`diskshare.count_as_own`). On H100 VMs it lost to both other ways (module doc,
        runs 78-84), so it is off by default."""
        if threading.active_count() > 1:
            return False
        try:
            r, w = os.pipe()
        except OSError:
            return False
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return False
        if pid == 0:  # pragma: no cover  (the child's coverage is not collected)
            os.close(r)
            self._apart(w, parent)
        os.close(w)
        self.child, self.apart = pid, True
        threading.Thread(target=self._follow, args=(r,), name="weightcache-prefetch-apart",
                         daemon=True).start()
        return True

    def _apart(self, w: int, parent: int) -> None:  # pragma: no cover  (in the child)
        """The child: census, then the full read where it is cold; one JSON line to `w`
        (APART_MAX bytes at most), then `os._exit`. It dies with its parent."""
        code = 1
        try:
            if not libc.request_parent_death_signal(parent, signal.SIGKILL):
                return
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # never the rank's stdout (the launcher's protocol)
                os.dup2(null, fd)
            _Opened.quiet.on = True
            census = self._take_census()
            if census is None or self._cold(census):
                self._read_all(self.files)
                self.done.wait()
                message: dict[str, Any] = {"done": self._snapshot()}
            else:
                index = {id(f): i for i, f in enumerate(self.files)}
                message = {"census": [census[0], [index[id(f)] for f in census[1]]],
                           "census_at": self._census_at}
            data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
            view = memoryview(data[:APART_MAX])
            while view:
                view = view[os.write(w, view):]
            code = 0
        finally:
            os._exit(code)

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"read": self._read, "resident": self._resident,
                    "files_read": self._files_read, "unread": self._unread,
                    "looked_up": self._looked_up, "seconds": self._seconds,
                    "census_at": self._census_at}

    def _follow(self, r: int) -> None:
        """This process's side: the child's line, then what it says. A census is acted on
        here (`_after_census`: the warm verdict, the lacking files read on this process's
        threads); a done read is counted and ends the prefetch; a child that ended without
        a line (killed, or given up) leaves the set unread, so that it is written anew."""
        data = b""
        try:
            while len(data) <= APART_MAX and (chunk := os.read(r, 1 << 16)):
                data += chunk
        except OSError:
            pass
        finally:
            os.close(r)
        try:
            message = json.loads(data) if data.endswith(b"\n") else {}
        except ValueError:
            message = {}
        try:
            if isinstance(message.get("census"), list):
                held, idx = message["census"]
                self._census_at = message.get("census_at")
                self._after_census((int(held), [self.files[i] for i in idx]))
                return
            done = message.get("done")
            if isinstance(done, dict):
                with self._lock:
                    self._read, self._resident = int(done["read"]), int(done["resident"])
                    self._files_read, self._unread = int(done["files_read"]), int(done["unread"])
                    self._looked_up = int(done["looked_up"])
                    self._census_at = done.get("census_at")
                self._seconds = float(done["seconds"])
                self._finish()
                return
        except (KeyError, IndexError, TypeError, ValueError):
            pass
        with self._lock:
            self._unread = max(self._unread, len(self.files) - self._files_read)
        self._end()

    def close(self) -> None:
        """Reap the reading process, if there was one (once the load's disk share has
        stopped: until reaped its reads are counted as its own, `/proc/<pid>/io`, and after
        as this process's, so a share that runs across the reap could count them twice)."""
        pid, self.child = self.child, None
        if pid is None:
            return
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)

    def wait_for_import(self, timeout_s: float) -> None:
        """Hold the import until the set is read (at most `timeout_s`), if `import_waits`."""
        if import_waits():
            t0 = time.monotonic()
            self.done.wait(timeout_s)
            self.import_waited = round(time.monotonic() - t0, 4)

    def needs_record(self) -> bool:
        """Whether this start should write the set anew: there was none (a seed read instead
        is the image's, without the node's own files: the driver's libraries, mounted at run
        time), or some of it named files that changed (an upgrade). A set that still matches
        is kept as the first start wrote it: a start on a warm node would write down every
        page that any process had cached of the same libraries (on the H200 VM a 555 MB set
        grew to 974 MB and 1.16 GB over later starts, and the prefetch's time with it)."""
        with self._lock:
            return not self.files or self.seeded or self._unread > 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"files": self._files_read, "unread": self._unread, "bytes": self._read,
                    "resident_bytes": self._resident,
                    "seconds": round(self._seconds if self.done.is_set()
                                     else time.monotonic() - self._started, 4),
                    "done": self.done.is_set(), "import_waited": self.import_waited,
                    "deep": self.deep, "looked_up": self._looked_up, "seeded": self.seeded,
                    "checked_only": self.checked_only, "warm": self.warm,
                    "apart": self.apart, "readers": self.readers,
                    "warm_at": self._warm_at,  # time.monotonic(), as READY's `marks`
                    "census_at": self._census_at,
                    "started_at": self._started,  # time.monotonic(), as READY's `marks`
                    "done_at": (self._started + self._seconds) if self.done.is_set() else None}
