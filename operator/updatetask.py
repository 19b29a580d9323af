"""One in-place update per cache, run beside its reconciler instead of inside it.

Why: an update lasts as long as its slowest node stages, pauses and writes (each phase may
take up to the RPC deadline, 900 s). Holding the per-cache lock for that long would make every
other reconcile of the cache (a spec change, status, a deletion) wait behind it. So a pass
starts the update as a task and returns at once; later passes read the phase it is in and,
once it is done, take its result. The task owns the update: at most one per cache; a pass that
wants another target (or finds another group) asks it to stop, and the next update starts
only when it has ended. A stop before COMMIT aborts every node (engines resume on the bytes
they served, written nodes roll back); COMMIT itself is never interrupted. Deletion and
operator shutdown stop the task and wait for it, so no engine is left paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from weightcache.operator.agentupdate import GroupResult

log = logging.getLogger(__name__)

Run = Callable[[asyncio.Event, Callable[[str], None]], Awaitable[GroupResult]]


@dataclass
class Running:
    """One update in flight: what it moves the group to, and who."""

    target: dict[str, str]  # {"path", "revision"}
    members: dict[str, tuple[str, str]]  # agent address -> (node, agent pod)
    task: asyncio.Task[GroupResult] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    phase: str = "PREPARE"
    why_stopped: str = ""
    started: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return f"{self.target['path']}@{self.target['revision']}"

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def ask_stop(self, why: str) -> None:
        if not self.stop.is_set():
            self.why_stopped = why
            self.stop.set()

    def result(self) -> GroupResult:
        """The task's result; a task that raised reads as a failed update."""
        assert self.task is not None and self.task.done()
        if self.task.cancelled():
            return GroupResult(False, "Stopped", "the update was cancelled")
        exc = self.task.exception()
        if exc is not None:
            return GroupResult(False, "UpdateFailed", f"{type(exc).__name__}: {exc}")
        return self.task.result()


class Updates:
    """The running update of each cache."""

    def __init__(self) -> None:
        self._running: dict[Any, Running] = {}

    def get(self, key: Any) -> Running | None:
        return self._running.get(key)

    def start(self, key: Any, running: Running, run: Run, done: Callable[[], None]) -> None:
        assert key not in self._running, "one update per cache"

        def phase(name: str) -> None:
            running.phase = name

        running.task = asyncio.get_running_loop().create_task(run(running.stop, phase))
        running.task.add_done_callback(lambda _: done())
        self._running[key] = running

    def take(self, key: Any) -> Running | None:
        """The finished update of `key` (forgotten from here on), or None."""
        running = self._running.get(key)
        if running is None or not running.done:
            return None
        return self._running.pop(key)

    async def stop(self, key: Any, why: str, timeout_s: float = 120.0) -> Running | None:
        """Stop the update of `key` and wait for its aborts (then forget it)."""
        running = self._running.pop(key, None)
        if running is None or running.task is None:
            return running
        running.ask_stop(why)
        try:
            await asyncio.wait_for(asyncio.shield(running.task), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            log.warning("the update to %s did not stop within %.0f s", running.label, timeout_s)
        except Exception as exc:  # the update's own failure: it ends all the same
            log.warning("the update to %s ended with %s", running.label, exc)
        return running

    async def stop_all(self, why: str, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            await asyncio.gather(*(self.stop(key, why, timeout_s)
                                   for key in list(self._running)))
