"""The threads that accept a rank's connections and serve them, kept between connections.

Why each thread accepts for itself: every attach starts with a connection, and what the
daemon does before it reads the first request is on the attach's clock. A bare Python
Unix-socket server on a 2-core VM answered a new connection's first message in 0.15-0.16 ms
with one accept loop starting a thread per connection (as this daemon did), 0.05-0.09 ms with
that loop handing connections to idle threads through a queue, and 0.017-0.018 ms with idle
threads blocked in `accept()` themselves; the daemon's connect and first `hello` went from
0.35-0.44 ms to 0.16-0.20 ms with this module (docs/results/cpu-2026-12-05-attach). The kernel
wakes one of the threads waiting in `accept()`, which serves the connection itself: one
wake-up, no hand-off, no thread start.

While a thread serves, another takes its place in `accept()` if none is left there (a
connection may last long: a `watch` holds its thread until the watcher leaves). A thread whose
connection ends goes back to `accept()` unless `keep` threads wait there already; then it
ends, so a burst leaves no crowd of threads behind. Live threads never exceed `limit` (the
connections a rank admits at once, plus `keep`): at the limit, the next connection waits in
the listen backlog for a thread to come back. Which connections are admitted is the caller's
decision (`RankServer._accepted`, with `limits.PeerLimiter`): this module only runs threads.
They are daemon threads: one holding a connection never keeps the rank's process from exiting.

Stopping: the rank's signal handler shuts the listener down (`SHUT_RDWR`), which makes every
blocked `accept()` fail; the threads then end. An `accept()` that fails while the listener is
meant to serve (EMFILE, say) is kept as `error` for the caller, as the single accept loop
raised it before.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("weightcache.daemon")

KEEP = 4  # threads waiting in accept(): an engine's attach, the agent's stats, a watcher


class Acceptors:
    """Threads that each `accept()` on `listener`, then `serve(conn)` what they accepted."""

    def __init__(self, listener: socket.socket, serve: Callable[[socket.socket], None],
                 name: str, keep: int = KEEP, limit: int = 1024) -> None:
        self._listener = listener
        self._serve = serve
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
        """No thread accepts again; busy ones end with their connection. The listener's
        shutdown is what wakes the threads blocked in accept()."""
        with self._lock:
            self._closed = True
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
                conn, _ = self._listener.accept()
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
            self._serve(conn)
            with self._lock:
                if self._closed or self._accepting >= self._keep:
                    return
                self._accepting += 1
