"""Engine side of in-place updates: take part in begin/finish, or push new weights.

A zero_copy engine maps the daemon's arena; an update rewrites that memory in place (every
address stays, so a captured CUDA graph keeps working). The engine must not run the model
while the bytes change, and afterwards must recompute whatever it derived from the weights
(the post-load processing of vLLM's direct reload: fused or transposed copies, scales...).

    result = attach(model_dir, device="cuda")
    gate = ModelGate()                          # wrap every forward in `with gate:`
    part = follow_updates(result, gate=gate, on_resume=lambda gen, changed: rederive())

`begin` closes the gate (waits for in-flight forwards, holds new ones), then acknowledges;
`finish` calls `on_resume(generation, True)` while the gate is still closed, then opens it;
`resumed` (an aborted update) reopens it with the old weights. A copy-mode engine owns its
bytes and is unaffected; it may re-copy in `on_resume` if it wants the new weights.

The other producer of an update, `push_update` (a process on the node, such as an RL trainer,
sending each rank's new tensors), is the coordinator's (`native/coordinator.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..shared import protocol as proto
from ..shared.connection import connect, raise_for, request
from ..shared.errors import WeightCacheError
from .attach import AttachResult

log = logging.getLogger("weightcache.updates")

OnResume = Callable[[int, bool], None]


class ModelGate:
    """Counts in-flight forwards; `close()` waits for them to finish and holds new ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False

    def __enter__(self) -> ModelGate:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._inflight += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._inflight:
                self._cond.wait()

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


class UpdateParticipant:
    """One engine's update stream to one daemon rank (a `watch` with a participant spec)."""

    def __init__(
        self,
        socket_path: str | os.PathLike,
        *,
        gate: ModelGate | None = None,
        on_pause: Callable[[], None] | None = None,
        on_resume: OnResume | None = None,
        on_broken: Callable[[str], None] | None = None,
        mode: str = "zero_copy",
        can_pause: bool = True,
        generation: int | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.path = Path(socket_path)
        self.gate = gate
        self.on_pause, self.on_resume, self.on_broken = on_pause, on_resume, on_broken
        self.generation = generation
        self.events: list[dict[str, Any]] = []  # every event handled, for logs and tests
        self._seen = threading.Condition()
        self._paused = False  # between an acknowledged begin and its finish/resumed
        self._closing = False
        self._ended = False
        self.broken: str | None = None
        self._sock = connect(self.path, timeout=connect_timeout_s)
        hello, _ = request(self._sock, "watch",
                           participant={"mode": mode, "can_pause": can_pause, "pid": os.getpid()})
        raise_for(hello)
        current = hello.get("generation")
        self._changed_since_attach = (
            generation is not None and isinstance(current, int) and current != generation
        )
        self.generation = current if isinstance(current, int) else generation
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weightcache-updates-{self.path.name}")
        self._thread.start()
        if self._changed_since_attach and self.on_resume is not None:
            # An update finished between our attach and this registration.
            self.on_resume(int(self.generation or 0), True)

    def _run(self) -> None:
        try:
            while True:
                event, _ = proto.recv_frame(self._sock)
                kind = event.get("event")
                if kind == "begin":
                    self._pause(event)
                elif kind in ("finish", "resumed"):
                    self._resumed(event)
                elif kind == "broken":
                    self.broken = str(event.get("message", "broken"))
                    if self.on_broken is not None:
                        try:
                            self.on_broken(self.broken)
                        except Exception:
                            log.exception("weightcache: on_broken failed")
                with self._seen:
                    self.events.append(event)
                    self._seen.notify_all()
        except (OSError, proto.ProtocolError):
            return
        finally:
            if self._paused and not self._closing and self.broken is None:
                # The daemon went away between begin and finish: the bytes may be half written.
                self.broken = "the daemon's update stream closed during an update"
                if self.on_broken is not None:
                    with contextlib.suppress(Exception):
                        self.on_broken(self.broken)
            with self._seen:
                self._ended = True
                self._seen.notify_all()

    def _pause(self, event: dict[str, Any]) -> None:
        if self.gate is not None:
            self.gate.close()
        try:
            if self.on_pause is not None:
                self.on_pause()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # in-flight kernels read the weights too
        except Exception:
            # No ack: the daemon's pause deadline expires and the update is called off.
            log.exception("weightcache: on_pause failed; not pausing for this update")
            if self.gate is not None:
                self.gate.open()
            return
        self._paused = True
        proto.send_frame(self._sock, {"ack": "paused", "update": event.get("update")})

    def _resumed(self, event: dict[str, Any]) -> None:
        self._paused = False
        generation = event.get("generation")
        changed = bool(event.get("changed"))
        if isinstance(generation, int):
            self.generation = generation
        try:
            if self.on_resume is not None:
                self.on_resume(int(self.generation or 0), changed)
        except Exception as exc:
            # What the engine derived from the weights may be stale: never run it. The gate
            # stays closed and the engine is told, as for a broken cache.
            log.exception("weightcache: on_resume(%s, %s) failed", self.generation, changed)
            self.broken = f"on_resume failed: {type(exc).__name__}: {exc}"
            if self.on_broken is not None:
                with contextlib.suppress(Exception):
                    self.on_broken(self.broken)
            return
        if self.gate is not None:
            self.gate.open()

    def wait_for(self, kind: str, count: int = 1, timeout: float = 60.0) -> bool:
        """Wait until `count` events of `kind` ("finish", "resumed") were handled; for
        "broken", until the engine was told its weights cannot be trusted (or the stream ended).
        """
        def done() -> bool:
            if kind == "broken":
                return self.broken is not None or self._ended
            return sum(e.get("event") == kind for e in self.events) >= count

        with self._seen:
            return self._seen.wait_for(done, timeout)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=5)


def follow_updates(result: AttachResult, **options: Any) -> UpdateParticipant | None:
    """Register `result`'s engine for updates of the rank it attached to (None: from disk)."""
    if result.source != "cache" or result.socket is None:
        return None
    return UpdateParticipant(result.socket, mode=result.mode, generation=result.generation,
                             **options)


__all__ = [
    "ModelGate",
    "UpdateParticipant",
    "WeightCacheError",
    "follow_updates",
]
