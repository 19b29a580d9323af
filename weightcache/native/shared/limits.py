"""How much of a daemon rank one client may hold, and for how long.

Every client is a same-uid (or allowed-uid) process, but one misbehaving engine or neighbour
must not starve the others. So, per rank:

- a request must arrive whole within REQUEST_DEADLINE_S of the connection becoming idle (the
  deadline covers the whole frame, not each recv, so trickling bytes does not extend it), and
  a reply must be taken within the same time;
- at most MAX_CONNECTIONS connections are served at once, at most PER_PID from one process
  and PER_UID from one uid (engines of one node all run as one uid: PER_UID only bounds
  foreign allowed uids below the total);
- `watch` connections leave the connection pool for their own, MAX_WATCHERS, with at most
  WATCH_PER_PID per process, so idle watchers can never refuse an attach;
- the listen backlog (LISTEN_BACKLOG) holds a node's engines connecting at once, so a burst
  of attaches queues in the kernel instead of failing with EAGAIN.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

DEADLINE_ENV = "WEIGHTCACHE_REQUEST_DEADLINE_S"  # operators (and tests) may shorten it


def _deadline() -> float:
    try:
        value = float(os.environ.get(DEADLINE_ENV, "") or 10.0)
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


REQUEST_DEADLINE_S = _deadline()
MAX_CONNECTIONS = 256
PER_PID = 32
PER_UID = 192
MAX_WATCHERS = 64
WATCH_PER_PID = 8
LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn (4096 by default)
MAX_COMMAND_LENGTH = 32


class PeerLimiter:
    """Counts slots per pid and uid; `acquire` refuses instead of blocking."""

    def __init__(self, total: int, per_pid: int, per_uid: int | None = None,
                 own_uid: int | None = None) -> None:
        """`own_uid` (the daemon's) is bounded by `total` and `per_pid` only."""
        self.total, self.per_pid, self.per_uid, self.own_uid = total, per_pid, per_uid, own_uid
        self._lock = threading.Lock()
        self._pids: Counter[int] = Counter()
        self._uids: Counter[int] = Counter()
        self.held = 0

    def acquire(self, pid: int, uid: int) -> str | None:
        """None when a slot was taken, otherwise why not."""
        with self._lock:
            if self.held >= self.total:
                return f"too many connections ({self.total})"
            if self._pids[pid] >= self.per_pid:
                return f"too many connections from pid {pid} ({self.per_pid})"
            if (self.per_uid is not None and uid != self.own_uid
                    and self._uids[uid] >= self.per_uid):
                return f"too many connections from uid {uid} ({self.per_uid})"
            self.held += 1
            self._pids[pid] += 1
            self._uids[uid] += 1
            return None

    def release(self, pid: int, uid: int) -> None:
        with self._lock:
            self.held -= 1
            for counter, key in ((self._pids, pid), (self._uids, uid)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]
