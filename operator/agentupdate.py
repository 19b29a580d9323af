"""Move a group's agents to a new model revision in place, all nodes at one barrier or none.

Why the phases: a multi-node group's ranks are split over agents, and engines of one group
must never run with some ranks on the old weights and some on the new. So every node first
stages (PREPARE; engines keep serving), then every node pauses its engines (PAUSE), and only
when all paused does any node write (WRITE; engines stay paused), and only when all wrote does
any node switch (COMMIT: finish, resume). A refusal or failure before COMMIT aborts every node,
and the whole group keeps the old generation: a node that already wrote puts back the copy of
its previous bytes it kept in host memory (reason RolledBack). Only where a node kept no copy
(host memory did not allow it, the agent says so at PREPARE), or a failure during COMMIT, are
ranks reported broken (UpdateFailed): they refuse engines until the next update or a restart.
A one-node group does the phases in one call (UPDATE_PHASE_ALL).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Daemon/agent error codes -> condition reasons (CamelCase, API conventions).
REASONS = {
    "layout_mismatch": "LayoutMismatch",
    "unpausable_engine": "EngineCannotPause",
    "pause_timeout": "PauseTimeout",
    "unsupported": "Unsupported",
    "unavailable": "AgentUnreachable",
    "bad_request": "BadRevision",
    "no_rollback": "NoRollback",
}
ROLLED_BACK = "RolledBack"


@dataclass
class NodeUpdate:
    ok: bool
    error: str = ""
    message: str = ""
    generation: int = 0
    broken: bool = False
    tensors: list[str] = field(default_factory=list)
    rolled_back: bool = False
    rollback: bool = False  # PREPARE: the node keeps a copy of its current bytes
    rollback_why: str = ""


@dataclass
class GroupResult:
    ok: bool
    reason: str = ""
    message: str = ""
    broken: bool = False
    generations: dict[str, int] = field(default_factory=dict)  # address -> generation
    no_rollback: str = ""  # why some node updated without a rollback copy ("" if none)


async def _call(address: str, phase: int, path: str, revision: str, force: bool,
                deadline_s: float, timeout_s: float) -> NodeUpdate:
    import grpc

    from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await agent_pb2_grpc.AgentStub(channel).Update(
                agent_pb2.UpdateRequest(phase=phase, model_path=path, revision=revision,
                                        force=force, pause_deadline_seconds=deadline_s),
                timeout=timeout_s)
    except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        return NodeUpdate(False, "unavailable", f"agent {address}: {detail}")
    return NodeUpdate(reply.ok, reply.error, reply.message, int(reply.generation), reply.broken,
                      list(reply.tensors), reply.rolled_back, reply.rollback, reply.rollback_why)


async def update_group(addresses: list[str], path: str, revision: str, *, force: bool = False,
                       deadline_s: float = 30.0, timeout_s: float = 900.0) -> GroupResult:
    from weightcache.contracts.proto import agent_pb2

    async def each(phase: int) -> list[NodeUpdate]:
        return list(await asyncio.gather(*(
            _call(a, phase, path, revision, force, deadline_s, timeout_s) for a in addresses)))

    def refused(replies: list[NodeUpdate], broken: bool = False) -> GroupResult:
        bad = next(r for r in replies if not r.ok)
        where = addresses[replies.index(bad)]
        message = f"{where}: {bad.message}"
        if bad.tensors:
            message += f" (tensors: {', '.join(bad.tensors[:8])})"
        if bad.rolled_back and not (broken or bad.broken):
            return GroupResult(False, ROLLED_BACK, f"{message}; every node was rolled back")
        reason = "UpdateFailed" if broken or bad.broken else REASONS.get(bad.error,
                                                                          "UpdateRefused")
        return GroupResult(False, reason, message, broken=broken or bad.broken)

    if not addresses:
        return GroupResult(False, "AgentUnreachable", "no ready agent to update")
    if len(addresses) == 1:
        replies = await each(agent_pb2.UPDATE_PHASE_ALL)
        if not replies[0].ok:
            return refused(replies)
    else:
        for phase in (agent_pb2.UPDATE_PHASE_PREPARE, agent_pb2.UPDATE_PHASE_PAUSE):
            replies = await each(phase)
            if not all(r.ok for r in replies):
                await each(agent_pb2.UPDATE_PHASE_ABORT)  # nobody switches
                return refused(replies)
        replies = await each(agent_pb2.UPDATE_PHASE_WRITE)
        if not all(r.ok for r in replies):
            aborts = await each(agent_pb2.UPDATE_PHASE_ABORT)
            # Whole again when every node that wrote put its old bytes back and no node that
            # failed its write is broken (an unreachable one lost its daemons' connections:
            # they rolled back, or broke, by themselves; the node's own status tells).
            whole = all(a.ok and a.rolled_back if w.ok else not w.broken
                        for w, a in zip(replies, aborts, strict=True))
            bad = next(r for r in replies if not r.ok)
            bad.rolled_back = whole
            return refused(replies, broken=not whole)
        replies = await each(agent_pb2.UPDATE_PHASE_COMMIT)
        if not all(r.ok for r in replies):
            return refused(replies, broken=True)
    # Every reply carries its node's PREPARE facts: say where no rollback copy was possible.
    no_rollback = next((f"{a}: {r.rollback_why or 'no copy kept'}"
                        for a, r in zip(addresses, replies, strict=True) if not r.rollback), "")
    return GroupResult(True, "Updated", "", generations={
        a: r.generation for a, r in zip(addresses, replies, strict=True)},
        no_rollback=no_rollback)
