"""The engine's expected shard, kept between attaches in one process while no file changes.

Planning a shard reads every header, parses it and lays out every tensor: microseconds per
tensor, paid again by each attach of the same checkpoint in a process (benchmarks, a server
that reloads, tools that attach twice). What the plan depends on is the bytes of the headers,
`config.json` and the index, and the directory's entries. So a plan is kept under the
arguments that shape it and reused only while

- the model directory, `config.json` and the index have the identity (device, inode, size,
  mtime, ctime; or absence) they had before the plan was made: an added, removed or renamed
  file changes the directory's mtime; and
- every checkpoint file still has the identity it had when it was planned, as the fresh
  content claim of this attach reports it (`content.sample_claim` fstat()s each file it
  samples): a write changes mtime and ctime, a replacement the inode.

A plan is kept only if all of those timestamps were older than RACY_S when planning started.
A file written within the same timestamp tick as our look at it could change again without
its identity changing (git's "racy clean" case); such a plan is used once and not kept.

A plan the daemon shipped (plantable.py) is kept the same way, under the same conditions: it
was bound to these files' bytes when it came.

The content claim itself is never cached: every attach samples fresh chunks and the daemon
checks them against every byte it loaded, exactly as without this cache.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..shared.checkpoint import INDEX_NAME
from ..shared.loader import ArenaLayout
from ..shared.plantable import ShippedTable

MAX_PLANS = 4  # a process attaches a handful of checkpoints (target, draft, a revision)
RACY_S = 2.0  # timestamps newer than this (before planning) may not yet name the bytes

Stamp = tuple[int, int, int, int, int] | None


def stamp(path: str | os.PathLike) -> Stamp:
    """(dev, ino, size, mtime_ns, ctime_ns) of what `path` resolves to; None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def directory_stamps(model_dir: Path) -> tuple[Stamp, Stamp, Stamp]:
    """The identities of what decides the file set and the aliases."""
    return stamp(model_dir), stamp(model_dir / INDEX_NAME), stamp(model_dir / "config.json")


def claimed_identities(claim: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Each claimed file's identity, in the claim's (the plan's file) order."""
    return tuple(tuple(entry["identity"]) for entry in claim["files"].values())


@dataclass(frozen=True)
class Plan:
    files: tuple[Path, ...]
    dirs: tuple[Stamp, Stamp, Stamp]
    identities: tuple[tuple[int, ...], ...]
    layout: ArenaLayout | ShippedTable  # this process' plan, or the daemon's bound to the files
    fingerprint: dict[str, Any]  # without `content`: the claim is fresh on every attach
    # A tensor-parallel rank's chunks per file (None at TP=1): its fresh claims sample there.
    share: dict[str, Any] | None = None


class PlanCache:
    def __init__(self, size: int = MAX_PLANS) -> None:
        self._size = size
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], dirs: tuple[Stamp, Stamp, Stamp]) -> Plan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                return None
            if plan.dirs != dirs:
                del self._plans[key]
                return None
            self._plans.move_to_end(key)
            return plan

    def peek(self, key: tuple[Any, ...]) -> Plan | None:
        """The plan kept for `key`, unchecked: a guess (copy mode starts allocating a block of
        its size before the plan is checked), never a plan to serve by."""
        with self._lock:
            return self._plans.get(key)

    def drop(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._plans.pop(key, None)

    def put(self, key: tuple[Any, ...], plan: Plan, started_ns: int) -> bool:
        """Keep `plan` unless one of its timestamps is too recent to trust (False then)."""
        newest = started_ns - int(RACY_S * 1e9)
        stamps = [*plan.dirs, *plan.identities]
        if any(s is not None and (s[3] >= newest or s[4] >= newest) for s in stamps):
            return False
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return True

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def now_ns() -> int:
    return time.time_ns()
