"""Load progress: a thread-safe byte counter and its rendering for people and machines.

A 400 GB model loads for minutes; without progress it looks hung. The daemon counts arena
bytes as the loader fills them and reports them as `LOADING {json}` lines on stdout (machine
lines, like `SERVING`); the launcher sums its ranks, shows a bar on a terminal or a plain line
every few seconds otherwise (logs must not fill with carriage returns), and serves the counts
on its health endpoint, where the node agent reads them for its Status.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO

GB = 1e9
TTY_INTERVAL_S = 0.2
PLAIN_INTERVAL_S = 5.0
BAR_WIDTH = 28


class Counter:
    """Bytes done so far, added to from the loader's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


def rate(done: int, seconds: float) -> float:
    """GB/s (0 when nothing can be said yet)."""
    return done / seconds / GB if seconds > 0 and done > 0 else 0.0


def eta_seconds(done: int, total: int, seconds: float) -> float | None:
    """Time left at the average rate so far; None before the first byte."""
    if done <= 0 or seconds <= 0 or total <= 0:
        return None
    return max(0.0, (total - done) * seconds / done)


def _eta_text(eta: float | None) -> str:
    if eta is None:
        return "ETA ?"
    eta = round(eta)
    if eta >= 3600:
        return f"ETA {eta // 3600}h{eta % 3600 // 60:02d}m"
    if eta >= 60:
        return f"ETA {eta // 60}m{eta % 60:02d}s"
    return f"ETA {eta}s"


def describe(done: int, total: int, seconds: float) -> str:
    """`5.20/16.06 GB (32%), 2.01 GB/s, ETA 5s`"""
    pct = 100.0 * done / total if total else 100.0
    return (f"{done / GB:.2f}/{total / GB:.2f} GB ({pct:.0f}%), {rate(done, seconds):.2f} GB/s,"
            f" {_eta_text(eta_seconds(done, total, seconds))}")


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = width if not total else min(width, width * done // total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class ProgressPrinter:
    """Prints progress to `stream` at most every `interval` seconds.

    On a terminal one line is redrawn in place (`\\r`) with a bar; otherwise a plain line is
    written at most every `PLAIN_INTERVAL_S` (logs stay readable). `finish` ends the line.
    """

    def __init__(
        self,
        stream: IO[str],
        label: str,
        *,
        tty: bool | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.label = label
        self.tty = bool(stream.isatty()) if tty is None else tty
        self.interval = interval if interval is not None else (
            TTY_INTERVAL_S if self.tty else PLAIN_INTERVAL_S)
        self.clock = clock
        self._last: float | None = None
        self._drawn = False

    def update(self, done: int, total: int, seconds: float, *, force: bool = False) -> bool:
        """Print if due (or forced); True when something was printed."""
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        text = f"{self.label}: {describe(done, total, seconds)}"
        if self.tty:
            self.stream.write(f"\r{self.label}: {bar(done, total)} {describe(done, total, seconds)}"
                              "\x1b[K")
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        return True

    def finish(self, done: int, seconds: float) -> None:
        """The closing line: bytes, seconds and GB/s of the whole load."""
        if self._drawn:
            self.stream.write("\n")
        self.stream.write(f"{self.label}: loaded {done / GB:.2f} GB in {seconds:.2f} s"
                          f" ({rate(done, seconds):.2f} GB/s)\n")
        self.stream.flush()


class Ticker:
    """Calls `tick()` every `interval` seconds on a daemon thread until `stop()`."""

    def __init__(self, tick: Callable[[], None], interval: float) -> None:
        self._tick = tick
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class PhaseClock:
    """Seconds spent in each named phase of a rank's start, in order (READY's `phases`), and
    the moments its start passed named steps (READY's `marks`).

    The marks are `time.monotonic()` readings: CLOCK_MONOTONIC is one clock for every process
    of the node, so the launcher's marks and a benchmark's spawn of the launcher line up with
    them, and the time before the first byte read can be taken apart across processes.
    """

    def __init__(self, started: float | None = None) -> None:
        self.phases: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self._mark = time.monotonic() if started is None else started

    def mark(self, name: str) -> None:
        """The phase `name` ended now; the next one starts."""
        now = time.monotonic()
        self.phases[name] = round(now - self._mark, 4)
        self._mark = now

    def stamp(self, name: str, at: float | None = None) -> None:
        """The start passed step `name` now (or `at`)."""
        self.marks[name] = time.monotonic() if at is None else at


def emit(line: str) -> None:
    """One machine-readable line on stdout, for the launcher (LOADING, SERVING)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
