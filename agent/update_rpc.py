"""The agent's side of in-place updates: the Update RPC, forwarded to this node's daemons.

Why phases over RPC: the ranks of a multi-node group live behind several agents, and they must
all switch at one barrier or none may. The operator calls PREPARE on every node (stage and
verify; engines keep serving), then PAUSE on every node, then WRITE on every node (engines stay
paused), then COMMIT (finish) on every node; a refusal anywhere before COMMIT makes it call ABORT
everywhere, so every node keeps the old generation: after WRITE each daemon writes back the host
copy of its previous bytes it kept at PREPARE (rollback; `UpdateOutcome.rolled_back`).
Between calls this agent holds the node's `GroupUpdate` (its daemon connections own the
update); a held update nobody moves on is aborted after a deadline, so a dead operator never
leaves engines paused (HOLD_PAUSED_S) or host staging pinned (HOLD_PREPARED_S).

After a successful update the runtime serves the new path from then on: a daemon restart by
the supervisor loads the revision the engines were switched to, not the one the pod started
with.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from weightcache.agent.runtimes.base import Runtime
from weightcache.native.coordinator import GroupUpdate, UpdateError

log = logging.getLogger("weightcache.agent.updates")

ALL, PREPARE, PAUSE, WRITE, COMMIT, ABORT = "all", "prepare", "pause", "write", "commit", "abort"
HOLD_PREPARED_S = 300.0
HOLD_PAUSED_S = 30.0
DEFAULT_PAUSE_DEADLINE_S = 30.0


@dataclass
class UpdateOutcome:
    ok: bool
    error: str = ""
    message: str = ""
    broken: bool = False
    report: dict[str, Any] | None = None
    tensors: list[str] | None = None
    rolled_back: bool = False  # bytes were written and every rank put the previous ones back


class AgentUpdater:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.revision = ""
        self._lock = threading.Lock()
        self._group: GroupUpdate | None = None
        self._phase = ""
        self._target: tuple[str, str] | None = None
        self._force = False
        self._timer: threading.Timer | None = None

    @property
    def model_path(self) -> str:
        return self.runtime.served_model()

    def update(self, *, phase: str, model_path: str, revision: str, force: bool,
               pause_deadline_s: float) -> UpdateOutcome:
        sockets = self.runtime.update_sockets()
        if sockets is None:
            return UpdateOutcome(False, "unsupported",
                                 f"runtime {self.runtime.name} cannot update in place; a "
                                 "revision change recreates the group")
        deadline = pause_deadline_s if pause_deadline_s > 0 else DEFAULT_PAUSE_DEADLINE_S
        with self._lock:
            try:
                return self._step(phase, sockets, model_path, revision, force, deadline)
            except UpdateError as exc:
                rolled_back = bool(exc.detail.get("rolled_back")) | self._drop()
                log.warning("update to %s refused: %s", model_path, exc)
                return UpdateOutcome(False, exc.code, str(exc), broken=exc.broken,
                                     tensors=list(exc.detail.get("tensors") or []),
                                     rolled_back=rolled_back)

    def _step(self, phase: str, sockets: list[str], model_path: str, revision: str,
              force: bool, deadline: float) -> UpdateOutcome:
        if phase == ABORT:
            rolled_back = self._drop()
            return UpdateOutcome(True, message="rolled back" if rolled_back else "aborted",
                                 rolled_back=rolled_back)
        if phase in (PREPARE, ALL):
            if not model_path:
                return UpdateOutcome(False, "bad_request", "model_path is required")
            self._drop()
            self._group = GroupUpdate(sockets)
            self._target, self._force = (model_path, revision), force
            self._group.prepare(model=model_path, force=force)
            self._phase = PREPARE
            self._arm(HOLD_PREPARED_S)
            if phase == PREPARE:
                return UpdateOutcome(True, report=dict(self._group.report))
        if self._group is None or self._target is None:
            return UpdateOutcome(False, "update_state", "no prepared update on this node")
        if model_path and self._target[0] != model_path:
            return UpdateOutcome(False, "update_state",
                                 f"the prepared update is for {self._target[0]}")
        if phase in (PAUSE, ALL):
            if self._phase != PREPARE:
                return UpdateOutcome(False, "update_state", f"update is {self._phase}")
            self._group.pause(force=self._force or force, deadline_s=deadline)
            self._phase = PAUSE
            self._arm(HOLD_PAUSED_S)
            if phase == PAUSE:
                return UpdateOutcome(True, report=dict(self._group.report))
        if phase == WRITE:
            if self._phase != PAUSE:
                return UpdateOutcome(False, "update_state", f"update is {self._phase}")
            self._group.write()
            self._phase = WRITE
            self._arm(HOLD_PAUSED_S)  # engines are paused: the same bound as after PAUSE
            return UpdateOutcome(True, report=dict(self._group.report))
        if phase in (COMMIT, ALL):
            if self._phase not in (PAUSE, WRITE):
                return UpdateOutcome(False, "update_state", f"update is {self._phase}")
            report = self._group.commit()
            self.runtime.serve_model(self._target[0])
            self.revision = self._target[1]
            log.info("updated in place to %s (revision %r, generation %s)", self._target[0],
                     self.revision, report.get("generation"))
            self._drop()
            return UpdateOutcome(True, report=report)
        return UpdateOutcome(False, "bad_request", f"unknown phase {phase!r}")

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        group = self._group
        self._timer = threading.Timer(seconds, self._expire, args=(group,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, group: GroupUpdate | None) -> None:
        with self._lock:
            if group is not None and group is self._group:
                log.warning("held update (%s) expired: aborting", self._phase)
                self._drop()

    def _drop(self) -> bool:
        """Abort and forget the held update; True when written bytes were rolled back."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        rolled_back = False
        if self._group is not None:
            self._group.abort()
            rolled_back = bool(self._group.report.get("rolled_back"))
            self._group.close()
        self._group, self._phase, self._target = None, "", None
        return rolled_back

    def generation(self, rank_stats: list[dict[str, Any] | None]) -> int:
        """The generation every rank serves (the lowest, should ranks disagree)."""
        gens = []
        for st in rank_stats:
            if not st:
                continue  # a rank whose stats could not be read says nothing
            upd = st.get("updates") if isinstance(st, dict) else None
            value = upd.get("generation", 1) if isinstance(upd, dict) else 1
            gens.append(value if isinstance(value, int) and not isinstance(value, bool) else 1)
        return min(gens) if gens else 1
