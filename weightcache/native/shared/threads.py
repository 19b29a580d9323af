"""A pool of threads whose work a signal can never leave running behind its caller.

A Python signal handler runs in the main thread between bytecodes, so its exception (a
`KeyboardInterrupt`, a `SIGTERM` handler's `SystemExit`, a test's alarm) can land inside the
`threading` calls a pool makes, and two of them then lose a thread that is still running:

- `Thread.join()` (CPython 3.11/3.12): when the exception interrupts the wait on the thread's
  state lock, the `except` of `_wait_for_tstate_lock` (bpo-45274) sees that lock held (by the
  running thread itself), releases it and marks the thread stopped. From then on
  `is_alive()` is False and `join()` returns at once, while the thread goes on running: a
  load's reader still writing into an arena that its caller believes stopped and frees.
  Measured on a 2-core machine with two busy loops beside it: a load stopped by a signal
  left a reader running in 10 of 20 runs.
- `Thread.start()`: after the OS thread exists but before `start()` has seen it run, the
  thread runs, yet `is_alive()` is False and `join()` raises.

Holding the signals with `pthread_sigmask` while starting does not help: the process's other
threads (a test runner's, torch's) still take the signal, and CPython then runs the handler in
the main thread at its next bytecode all the same.

Starting threads costs their caller too: `Thread.start()` waits until the new thread runs.
Beside busy threads on a 2-core machine, a rank's main thread took 0.46 s to start the 32
early readers, in front of its `import torch`. `start(background=True)` hands the starts to
one helper thread and returns at once; `wait()` then also waits for the helper.

So a `Pool` never asks `threading` which threads run. Each thread passes a gate before its
work, counted under the pool's lock; `close()` shuts the gate (a thread not past it yet does
nothing at all) and waits, on that count, for the work already begun. A condition wait that a
signal interrupts leaves nothing behind, so a caller's `except` can always `close()` again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable


class Pool:
    """`count` threads, each running `target(index)` once it passes the gate; `on_last()`,
    if given, on the thread that finishes last (whether or not it was let in)."""

    def __init__(self, target: Callable[[int], None], count: int, name: str, *,
                 daemon: bool = False, on_last: Callable[[], None] | None = None) -> None:
        self._target = target
        self._on_last = on_last
        self._cond = threading.Condition()
        self._open = True
        self._launched = 0  # start() calls that returned
        self._starting = False  # a helper thread is still starting them (background)
        self.start_error: RuntimeError | None = None  # a thread the helper could not start
        self._finished = 0  # threads past the end of _run (their work done, or refused)
        self._working = 0  # threads inside target() now
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}",
                                         daemon=daemon) for i in range(count)]

    def _run(self, index: int) -> None:
        with self._cond:
            admitted = self._open
            if admitted:
                self._working += 1
        try:
            if admitted:
                self._target(index)
        finally:
            with self._cond:
                if admitted:
                    self._working -= 1
                self._finished += 1
                last = self._finished == len(self.threads)
                self._cond.notify_all()
            if last and self._on_last is not None:
                self._on_last()

    def start(self, *, background: bool = False) -> Pool:
        """Start every thread; with `background`, on a helper thread, returning at once (the
        module's docstring). A thread the helper cannot start (the process is out of threads)
        ends its starting: the others work, and `start_error` says so."""
        if not background:
            self._launch()
            return self
        with self._cond:
            self._starting = True
        try:
            threading.Thread(target=self._launch_all, name=f"{self.threads[0].name}-start"
                             if self.threads else "pool-start", daemon=True).start()
        except BaseException:
            # The helper may run all the same (a signal's exception after its OS thread
            # began): whatever it starts from now on does nothing.
            with self._cond:
                self._open = False
                self._starting = False
                self._cond.notify_all()
            raise
        return self

    def _launch(self) -> None:
        for t in self.threads:
            t.start()
            with self._cond:
                self._launched += 1

    def _launch_all(self) -> None:
        try:
            self._launch()
        except RuntimeError as exc:  # can't start new thread: those started still work
            self.start_error = exc
        finally:
            with self._cond:
                self._starting = False
                self._cond.notify_all()

    def wait(self) -> None:
        """Until every started thread has done its work. After an exception here or in
        `start()` (a signal's), the caller tells its work to stop and calls `close()`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._starting and self._finished >= self._launched)
        self._join(None)

    def close(self) -> None:
        """No thread starts its work from now on; wait for the work already begun."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._working == 0)
        self._join(1.0)

    def _join(self, timeout: float | None) -> None:
        """Let the threads' own exits finish too (brief: their work is over), so that
        `threading.enumerate()` no longer lists them."""
        for t in self.threads:
            if t.ident is not None:
                with contextlib.suppress(RuntimeError):  # started, not yet running
                    t.join(timeout)

    @property
    def working(self) -> int:
        with self._cond:
            return self._working
