"""WeightCache status following the Kubernetes API conventions.

Three conditions (Ready, Progressing, Degraded) summarised by `phase`. A condition keeps its
`lastTransitionTime` while its status stays the same, so rewriting an unchanged status is a
no-op the reconciler can skip. `transition_event` names the event a phase change deserves.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightcache.operator.spec import Problem

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)
UPDATING = "Updating"  # present once the model revision changed (set by `with_updating`)
SEEDING = "Seeding"  # present while warmup seeding applies (operator/handlers.py, `_seed`)
MAX_MESSAGE = 32768  # metav1.Condition message limit (apimachinery ValidateCondition)
NODES_NAMED = 8  # messages name this many nodes, then count the rest


def node_list(names: Sequence[str]) -> str:
    """Names for a message: a 256-node group must not make a message of 65 000 characters."""
    shown = ", ".join(names[:NODES_NAMED])
    return shown if len(names) <= NODES_NAMED else f"{shown} and {len(names) - NODES_NAMED} more"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Cond:
    status: bool
    reason: str
    message: str = ""


@dataclass(frozen=True)
class NodeState:
    """One placed node as the reconciler observed it."""

    node: str
    rank: int
    ranks_total: int
    pod: str = ""
    ready: bool = False
    restarts: int = 0

    def as_status(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "rank": self.rank,
            "ranksReady": self.ranks_total if self.ready else 0,
            "ranksTotal": self.ranks_total,
            "ready": self.ready,
            "pod": self.pod,
            "restarts": self.restarts,
        }


def conditions(
    previous: Sequence[Mapping[str, Any]] | None,
    wanted: Mapping[str, Cond],
    generation: int | None,
) -> list[dict[str, Any]]:
    """New conditions; a condition's lastTransitionTime moves only when its status flips."""
    old = {c.get("type"): c for c in previous or ()}
    out = []
    for kind in CONDITION_TYPES:
        cond = wanted[kind]
        status = "True" if cond.status else "False"
        prev = old.get(kind) or {}
        entry = {
            "type": kind,
            "status": status,
            "reason": cond.reason,
            "message": cond.message[:MAX_MESSAGE],
            "lastTransitionTime": prev.get("lastTransitionTime")
            if prev.get("status") == status
            else now(),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        out.append(entry)
    return out


def build(
    previous: Mapping[str, Any],
    *,
    phase: str,
    wanted: Mapping[str, Cond],
    generation: int | None,
    epoch: int | None = None,
    nodes: Sequence[NodeState] = (),
    bytes_cached: int | None = None,
    message: str = "",
) -> dict[str, Any]:
    ranks_total = sum(n.ranks_total for n in nodes)
    ranks_ready = sum(n.ranks_total for n in nodes if n.ready)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions(previous.get("conditions"), wanted, generation),
        "epoch": previous.get("epoch", 0) if epoch is None else epoch,
        "ranksReady": ranks_ready,
        "ranksTotal": ranks_total,
        "ranks": f"{ranks_ready}/{ranks_total}",
        "readyNodes": sum(1 for n in nodes if n.ready),
        "nodes": [n.as_status() for n in nodes],
        "bytesCached": previous.get("bytesCached", 0) if bytes_cached is None else bytes_cached,
        "message": message[:MAX_MESSAGE],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid(previous: Mapping[str, Any], problems: Sequence[Problem], generation: int | None):
    message = "; ".join(str(p) for p in problems)
    reason = "InvalidSpec"
    return build(
        previous,
        phase="Invalid",
        wanted={
            READY: Cond(False, reason, "the spec cannot be placed"),
            PROGRESSING: Cond(False, reason, message),
            DEGRADED: Cond(True, reason, message),
        },
        generation=generation,
        nodes=[],
        message=message,
    )


def unschedulable(
    previous: Mapping[str, Any],
    *,
    need: int,
    eligible: int,
    reasons: Mapping[str, int],
    generation: int | None,
) -> dict[str, Any]:
    why = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    message = f"need {need} eligible nodes, found {eligible} ({need - eligible} missing)" + (
        f"; ineligible nodes: {why}" if why else ""
    )
    was_placed = bool(previous.get("nodes"))
    return build(
        previous,
        phase="Unschedulable",
        wanted={
            READY: Cond(False, "Unschedulable", message),
            PROGRESSING: Cond(False, "Unschedulable", message),
            DEGRADED: Cond(was_placed, "NodesLost" if was_placed else "AsExpected", message),
        },
        generation=generation,
        nodes=[],
        message=message,
    )


def observed(
    previous: Mapping[str, Any],
    *,
    nodes: Sequence[NodeState],
    pods_seen: int,
    epoch: int,
    generation: int | None,
    bytes_cached: int | None = None,
) -> dict[str, Any]:
    """Status of a placed group from its agent pods' readiness (bytes: None keeps the last)."""
    total = len(nodes)
    ready = sum(1 for n in nodes if n.ready)
    # Degraded means a group that served lost ranks; a new epoch or a new spec is a rollout.
    was_ready = (
        previous.get("phase") in ("Ready", "Degraded")
        and previous.get("epoch") == epoch
        and previous.get("observedGeneration") == generation
    )
    ranks = f"{sum(n.ranks_total for n in nodes if n.ready)}/{sum(n.ranks_total for n in nodes)}"
    if ready == total:
        phase = "Ready"
        wanted = {
            READY: Cond(True, "AllRanksReady", f"{ranks} ranks ready on {total} node(s)"),
            PROGRESSING: Cond(False, "Complete", "the group is loaded"),
            DEGRADED: Cond(False, "AsExpected"),
        }
    elif was_ready:
        missing = node_list([n.node for n in nodes if not n.ready])
        message = f"{ranks} ranks ready; not ready on {missing}"
        phase = "Degraded"
        wanted = {
            READY: Cond(False, "RanksNotReady", message),
            PROGRESSING: Cond(True, "Recovering", message),
            DEGRADED: Cond(True, "RanksNotReady", message),
        }
    elif pods_seen == 0:
        phase = "Placing"
        message = f"placed on {node_list([n.node for n in nodes])}; waiting for agent pods"
        wanted = {
            READY: Cond(False, "Placing", message),
            PROGRESSING: Cond(True, "Placing", message),
            DEGRADED: Cond(False, "AsExpected"),
        }
    else:
        phase = "Loading"
        message = f"{ranks} ranks ready; loading weights"
        wanted = {
            READY: Cond(False, "Loading", message),
            PROGRESSING: Cond(True, "Loading", message),
            DEGRADED: Cond(False, "AsExpected"),
        }
    return build(
        previous,
        phase=phase,
        wanted=wanted,
        generation=generation,
        epoch=epoch,
        nodes=nodes,
        bytes_cached=bytes_cached,
        message="" if phase == "Ready" else wanted[READY].message,
    )


def failed(
    previous: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    generation: int | None,
    nodes: Sequence[NodeState] = (),
    epoch: int | None = None,
) -> dict[str, Any]:
    """The operator cannot converge: the API server rejected a write, pods are not created.

    `reason` is a condition reason (ApplyRejected, ApplyFailed, FailedCreate, PodSecurity);
    `message` says what the server said, so `kubectl get wc` shows the cause.
    """
    message = message[:MAX_MESSAGE]
    return build(
        previous,
        phase="Failed",
        wanted={
            READY: Cond(False, reason, message),
            PROGRESSING: Cond(False, reason, message),
            DEGRADED: Cond(True, reason, message),
        },
        generation=generation,
        epoch=epoch,
        nodes=nodes,
        message=message,
    )


# phase -> (event type, reason) posted when a cache enters the phase.
PHASE_EVENTS = {
    "Placing": ("Normal", "Placed"),
    "Loading": ("Normal", "Loading"),
    "Ready": ("Normal", "Ready"),
    "Degraded": ("Warning", "Degraded"),
    "Invalid": ("Warning", "InvalidSpec"),
    "Unschedulable": ("Warning", "Unschedulable"),
    "Failed": ("Warning", "Failed"),  # the event takes the Ready condition's reason
}


def transition_event(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(type, reason, message) when the phase changed, or an Invalid/Unschedulable cause did."""
    phase = new.get("phase")
    if phase not in PHASE_EVENTS:
        return None
    changed = old.get("phase") != phase
    if phase in ("Invalid", "Unschedulable", "Failed") and old.get("message") != new.get("message"):
        changed = True
    if not changed:
        return None
    kind, reason = PHASE_EVENTS[phase]
    ready = next((c for c in new.get("conditions", []) if c["type"] == READY), {})
    if phase == "Failed":
        reason = ready.get("reason") or reason
    message = new.get("message") or ready.get("message") or phase
    return kind, reason, message


def with_updating(
    status: dict[str, Any], previous: Mapping[str, Any], cond: Cond | None,
    generation: int | None,
) -> dict[str, Any]:
    """Add (or carry) the Updating condition; None carries the previous one unchanged."""
    return with_condition(status, previous, UPDATING, cond, generation)


def condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def with_condition(
    status: dict[str, Any], previous: Mapping[str, Any], kind: str, cond: Cond | None,
    generation: int | None, *, carry: bool = True,
) -> dict[str, Any]:
    """Add the optional condition `kind` (Updating, Seeding); None carries the previous one
    unchanged (`carry`) or leaves it out."""
    old = condition(previous, kind)
    if cond is None:
        if old is not None and carry:
            status["conditions"] = [*status["conditions"], dict(old)]
        return status
    flag = "True" if cond.status else "False"
    entry = {
        "type": kind, "status": flag, "reason": cond.reason,
        "message": cond.message[:MAX_MESSAGE],
        "lastTransitionTime": old.get("lastTransitionTime")
        if old is not None and old.get("status") == flag else now(),
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    status["conditions"] = [*status["conditions"], entry]
    return status


def same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing `new` would change nothing a user can see."""
    keys = set(old) | set(new)
    return all(old.get(k) == new.get(k) for k in keys)
