"""What a starting process waits on, sampled from outside: where READY's start goes.

Why: with every cache dropped, a rank's start took 6.5 s beside its early reads on the H200
against 2.9 s with only the model cold, while its import set had been read by 0.6 s and the
disk's share saw no page fault. A fault counter and a disk timeline say that the start waits,
not on what. This sampler reads, every INTERVAL, the main thread's state and current system
call from `/proc/<pid>/task/<pid>/{stat,syscall}` (the ptrace access a root or same-user
benchmark has), and names what a blocked call works on: the file behind a descriptor, the
path a lookup was given (read from `/proc/<pid>/mem`), or, for a page fault taken in user
code (no system call), the mapped file the faulting instruction runs from. Each sample is one
class, such as `cpu`, `disk read /usr/lib/x.so`, `disk fault libtorch_cuda.so` or
`sleep futex`; the report sums the seconds of each.

Only the benchmark uses it, never the product: it changes nothing in the processes it
watches, and where `/proc` denies it a look, a sample is `unknown`.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

INTERVAL = 0.005
BIN_S = 0.25
TOP = 25
RANK_MARK = "weightcache.native.daemon"  # a rank's command line (`python -m ...`)

# x86_64 numbers of the calls a start blocks in; elsewhere a call is shown by its number.
_X86_64 = {
    0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 6: "lstat", 7: "poll",
    8: "lseek", 9: "mmap", 10: "mprotect", 11: "munmap", 12: "brk", 16: "ioctl", 17: "pread64",
    19: "readv", 21: "access", 23: "select", 59: "execve", 61: "wait4", 72: "fcntl",
    89: "readlink", 202: "futex", 217: "getdents64", 221: "fadvise64", 230: "clock_nanosleep",
    232: "epoll_wait", 257: "openat", 262: "newfstatat", 267: "readlinkat",
    269: "faccessat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 295: "preadv",
    327: "preadv2", 332: "statx", 437: "openat2", 439: "faccessat2",
}
_NAMES = _X86_64 if platform.machine() == "x86_64" else {}
_FD_ARG = {"read": 0, "pread64": 0, "readv": 0, "preadv": 0, "preadv2": 0, "fstat": 0,
           "getdents64": 0, "ioctl": 0, "mmap": 4, "fadvise64": 0}
_PATH_ARG = {"open": 0, "stat": 0, "lstat": 0, "access": 0, "readlink": 0, "execve": 0,
             "openat": 1, "newfstatat": 1, "statx": 1, "readlinkat": 1, "faccessat": 1,
             "openat2": 1, "faccessat2": 1}


class Process:
    """One watched process: its main thread's samples, classified as they are taken."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, str]] = []
        self._maps: list[tuple[int, int, str]] = []

    def sample(self, t: float) -> bool:
        """One sample at `t`; False once the process is gone."""
        task = f"/proc/{self.pid}/task/{self.pid}"
        try:
            stat = Path(f"{task}/stat").read_text()
            call = Path(f"{task}/syscall").read_text().split()
        except FileNotFoundError:
            return False
        except OSError:
            self.samples.append((t, "unknown"))
            return True
        state = stat[stat.rindex(")") + 2]
        self.samples.append((t, self._classify(state, call)))
        return True

    def _classify(self, state: str, call: list[str]) -> str:
        if state == "R" or not call or call[0] == "running":
            return "cpu"
        kind = "disk" if state == "D" else "sleep"
        if call[0] == "-1":  # blocked outside a system call: a page fault in user code
            pc = int(call[-1], 16) if len(call) >= 3 else 0
            return f"{kind} fault {self._mapped(pc)}"
        try:
            nr = int(call[0])
            args = [int(a, 16) for a in call[1:7]]
        except ValueError:
            return f"{kind} ?"
        name = _NAMES.get(nr, f"syscall{nr}")
        if kind == "sleep" and name not in _FD_ARG and name not in _PATH_ARG:
            return f"sleep {name}"
        if name in _FD_ARG and len(args) > _FD_ARG[name]:
            return f"{kind} {name} {self._fd(args[_FD_ARG[name]])}"
        if name in _PATH_ARG and len(args) > _PATH_ARG[name]:
            return f"{kind} {name} {self._string(args[_PATH_ARG[name]])}"
        return f"{kind} {name}"

    def _fd(self, fd: int) -> str:
        if fd >= 1 << 31:  # -1 as the kernel shows an int argument: an anonymous mapping
            return "anonymous"
        try:
            return os.readlink(f"/proc/{self.pid}/fd/{fd}")
        except OSError:
            return f"fd{fd}"

    def _string(self, address: int) -> str:
        try:
            with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
                mem.seek(address)
                raw = mem.read(256)
        except (OSError, OverflowError, ValueError):
            return "?"
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or "?"

    def _mapped(self, pc: int) -> str:
        for refresh in (False, True):
            if refresh:
                self._maps = _maps(self.pid)
            for lo, hi, path in self._maps:
                if lo <= pc < hi:
                    return os.path.basename(path)
        return "anonymous"

    def report(self, until: float | None = None) -> dict[str, Any]:
        """Seconds per class (the TOP largest), and each BIN_S's most sampled class."""
        samples = [(t, c) for t, c in self.samples if until is None or t <= until]
        if not samples:
            return {"pid": self.pid, "samples": 0}
        span = samples[-1][0] - samples[0][0]
        each = span / max(1, len(samples) - 1)
        counts = Counter(c for _, c in samples)
        bins: dict[int, Counter[str]] = {}
        for t, c in samples:
            bins.setdefault(int((t - samples[0][0]) / BIN_S), Counter())[c] += 1
        timeline = []
        for k in sorted(bins):
            top, n = bins[k].most_common(1)[0]
            timeline.append([round(k * BIN_S, 2), top, round(n / sum(bins[k].values()), 2)])
        return {
            "pid": self.pid, "samples": len(samples),
            "from_s": round(samples[0][0], 3), "to_s": round(samples[-1][0], 3),
            "seconds": {c: round(n * each, 3) for c, n in counts.most_common(TOP)},
            "timeline": {"bin_s": BIN_S, "columns": ["t_s", "class", "share"],
                         "rows": timeline},
        }


def _maps(pid: int) -> list[tuple[int, int, str]]:
    found = []
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            lo, hi = parts[0].split("-")
            found.append((int(lo, 16), int(hi, 16), parts[5]))
    return found


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class StartWaits:
    """Samples a `weightcache preload` launcher and, once it has spawned it, its first rank,
    from its creation until `stop()`, which says where each one's time went."""

    def __init__(self, launcher_pid: int, t0: float | None = None,
                 interval: float = INTERVAL) -> None:
        self.launcher = Process(launcher_pid)
        self.rank: Process | None = None
        self.interval = interval
        self._t0 = time.perf_counter() if t0 is None else t0  # perf_counter() of the spawn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="start-waits", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        watched = [self.launcher]
        while not self._stop.is_set():
            t = time.perf_counter() - self._t0
            watched = [p for p in watched if p.sample(t)]
            if self.rank is None:
                for child in _children(self.launcher.pid):
                    if RANK_MARK in _cmdline(child):
                        self.rank = Process(child)
                        watched.append(self.rank)
                        break
            if not watched:
                return
            self._stop.wait(self.interval)

    def stop(self, rank_start_until: float | None = None) -> dict[str, Any]:
        """Stop sampling; the report (seconds from the launcher's spawn), with the rank's
        start on its own (`rank_start`: its samples until `rank_start_until`) when given."""
        self._stop.set()
        self._thread.join()
        out = {"interval_s": self.interval, "launcher": self.launcher.report()}
        if self.rank is not None:
            out["rank"] = self.rank.report()
            if rank_start_until is not None:
                start = self.rank.report(until=rank_start_until)
                start.pop("timeline", None)
                out["rank_start"] = start
        return out
