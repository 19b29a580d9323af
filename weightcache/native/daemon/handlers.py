"""The threads that accept a rank's connections and serve them, kept between connections.

Why each thread accepts for itself: every attach starts with a connection, and what the
daemon does before it reads the first request is on the attach's clock. A bare Python
Unix-socket server on a 2-core VM answered a new connection's first message in 0.14-0.23 ms
with one accept loop starting a thread per connection (as this daemon did), 0.04-0.08 ms with
that loop handing connections to idle threads through a queue, 0.013-0.018 ms with idle
threads blocked in `accept()` themselves, and 0.03-0.05 ms with those threads taking turns at
a lock around `accept()` (this module); the daemon's connect and first `hello` went from
0.43-0.45 ms to 0.18-0.20 ms (docs/results/cpu-2026-12-05-attach). The thread in `accept()`
wakes and serves the connection itself: one wake-up, no hand-off, no thread start. The lock
makes the accept and the admission one connection at a time, so connections are admitted in
the order they came (the one past a limit is the one refused).

While a thread serves, another takes its place in `accept()` if none is left there (a
connection may last long: a `watch` holds its thread until the watcher leaves). A thread whose
connection ends goes back to `accept()` unless `keep` threads wait there already; then it
ends, so a burst leaves no crowd of threads behind. Live threads never exceed `limit` (a rank
passes the connections it admits at once, plus one): at the limit, the next connection waits
in the listen backlog for a thread to come back. Which connections are admitted is the
caller's decision (`RankServer._take`, with `limits.PeerLimiter`): this module only runs
threads. They are daemon threads: one holding a connection never keeps the rank's process from
exiting.

Stopping: the rank's signal handler, or `close()`, shuts the listener down (`SHUT_RDWR`),
which makes every blocked `accept()` fail; the threads then end. An `accept()` that fails
while the listener is meant to serve (EMFILE, say) is kept as `error` for the caller, as the
single accept loop raised it before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("weightcache.daemon")

KEEP = 4  # threads ready to accept: an engine's attach, the agent's stats, a watcher


class Acceptors:
    """Threads that each `accept()` on `listener` and run what `take(conn)` returns for it.

    `take` runs in the order the kernel queued the connections (one thread accepts and takes
    at a time): it decides at once whether a connection is admitted (a slot) and returns the
    work for it, which runs after, beside the others. So the connection past a limit is the
    one refused, as with a single accept loop; only the serving runs in parallel.
    """

    def __init__(self, listener: socket.socket,
                 take: Callable[[socket.socket], Callable[[], None]],
                 name: str, keep: int = KEEP, limit: int = 1024) -> None:
        self._listener = listener
        self._take = take
        self._order = threading.Lock()  # accept() and take() of one connection at a time
        self._name = name
        self._keep = max(1, keep)
        self._limit = max(self._keep, limit)
        self._lock = threading.Lock()
        self._accepting = 0  # threads in (or on their way into) accept()
        self._live = 0  # threads started and not yet ended
        self._started = 0
        self._closed = False
        self.error: OSError | None = None  # an accept() that failed while serving
        self.wake = threading.Event()  # set with `error`, and by close(): look again

    def start(self) -> Acceptors:
        """The listener blocks in accept() from now on; `keep` threads wait there."""
        self._listener.settimeout(None)
        for _ in range(self._keep):
            self._start()
        return self

    def close(self) -> None:
        """No thread accepts again (the listener is shut down, which wakes every thread
        blocked in accept()); busy ones end with their connection. The caller closes the
        listener itself, once no thread can be about to call accept() on it."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):  # shut down already (the rank's signal handler)
            self._listener.shutdown(socket.SHUT_RDWR)
        self.wake.set()

    @property
    def accepting(self) -> int:
        with self._lock:
            return self._accepting

    @property
    def live(self) -> int:
        with self._lock:
            return self._live

    def _start(self) -> bool:
        with self._lock:
            if self._closed or self._live >= self._limit:
                return False
            self._started += 1
            self._live += 1
            self._accepting += 1  # counted before it runs: no second one started for it
            name = f"{self._name}-{self._started}"
        try:
            threading.Thread(target=self._run, name=name, daemon=True).start()
        except RuntimeError:  # no thread can start now: the others still accept
            with self._lock:
                self._live -= 1
                self._accepting -= 1
            log.warning("cannot start a connection thread; %d still accept", self.accepting)
            return False
        return True

    def _run(self) -> None:
        try:
            self._accept_and_serve()
        finally:
            with self._lock:
                self._live -= 1

    def _accept_and_serve(self) -> None:
        while True:
            try:
                with self._order:
                    conn, _ = self._listener.accept()
                    try:
                        work = self._take(conn)
                    except Exception:  # a bug must not cost the rank an accepting thread
                        log.exception("cannot admit a connection")
                        conn.close()
                        continue
            except OSError as exc:
                with self._lock:
                    self._accepting -= 1
                    closed = self._closed
                if not closed and self.error is None:
                    self.error = exc
                    self.wake.set()
                return
            with self._lock:
                self._accepting -= 1
                alone = self._accepting == 0
            if alone:
                self._start()  # someone accepts while this thread serves
            work()
            with self._lock:
                if self._closed or self._accepting >= self._keep:
                    return
                self._accepting += 1
