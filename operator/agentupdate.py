"""Move a group's agents to a new model revision in place, all nodes at one barrier or none.

Why the phases: a multi-node group's ranks are split over agents, and engines of one group
must never run with some ranks on the old weights and some on the new. So every node first
stages (PREPARE; engines keep serving), then every node pauses its engines (PAUSE), and only
when all paused does any node write (WRITE; engines stay paused), and only when all wrote does
any node switch (COMMIT: finish, resume). A refusal or failure before COMMIT aborts every node,
and the whole group keeps the old generation: a node that already wrote puts back the copy of
its previous bytes it kept in host memory (reason RolledBack). The first node commits alone, so
a failure of its COMMIT still rolls every node back; only after it switched can nothing be
undone: a failure among the others is reported node by node (PartiallyUpdated, which node
serves which generation). Where a node kept no copy (host memory did not allow it, the agent
says so at PREPARE) a failure after the write leaves ranks broken (UpdateFailed): they refuse
engines until the next update or a restart. A one-node group runs the same phases.

The caller may stop an update before COMMIT (`stop`, or cancelling it): every node is aborted,
so no engine is left paused (reason Stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
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
STOPPED = "Stopped"  # asked to stop before COMMIT: every node aborted, nothing switched
PARTIAL = "PartiallyUpdated"  # a failure after the first COMMIT: nodes on two generations


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
    failed: dict[str, str] = field(default_factory=dict)  # PARTIAL: address -> what it serves


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


class Stopped(Exception):
    """The update was asked to stop before COMMIT (a newer target, a deletion, a shutdown)."""


async def update_group(addresses: list[str], path: str, revision: str, *, force: bool = False,
                       deadline_s: float = 30.0, timeout_s: float = 900.0,
                       stop: asyncio.Event | None = None,
                       progress: Callable[[str], None] | None = None) -> GroupResult:
    """Run the phases on every node; `stop` set before COMMIT aborts every node (reason
    Stopped), as does cancelling the caller. COMMIT is never interrupted."""
    from weightcache.contracts.proto import agent_pb2

    async def each(phase: int, among: list[str] | None = None) -> list[NodeUpdate]:
        return list(await asyncio.gather(*(
            _call(a, phase, path, revision, force, deadline_s, timeout_s)
            for a in (addresses if among is None else among))))

    async def stoppable(phase: int) -> list[NodeUpdate]:
        """One phase on every node, given up when `stop` is set (the agents finish the step
        they run; the ABORT that follows waits for it on each agent)."""
        if progress is not None:
            progress(agent_pb2.UpdatePhase.Name(phase).removeprefix("UPDATE_PHASE_"))
        calls = asyncio.ensure_future(each(phase))
        if stop is None:
            return await calls
        waiter = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({calls, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if calls.done():
            return calls.result()
        calls.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await calls
        raise Stopped

    def refused(replies: list[NodeUpdate], broken: bool = False,
                among: list[str] | None = None) -> GroupResult:
        among = addresses if among is None else among
        bad = next(r for r in replies if not r.ok)
        where = among[replies.index(bad)]
        message = f"{where}: {bad.message}"
        if bad.tensors:
            message += f" (tensors: {', '.join(bad.tensors[:8])})"
        if bad.rolled_back and not (broken or bad.broken):
            return GroupResult(False, ROLLED_BACK, f"{message}; every node was rolled back")
        reason = "UpdateFailed" if broken or bad.broken else REASONS.get(bad.error,
                                                                          "UpdateRefused")
        return GroupResult(False, reason, message, broken=broken or bad.broken)

    def whole(written: list[NodeUpdate], aborts: list[NodeUpdate]) -> bool:
        # Whole again when every node that wrote put its old bytes back and no node that
        # failed its write is broken (an unreachable one lost its daemons' connections:
        # they rolled back, or broke, by themselves; the node's own status tells).
        return all(a.ok and a.rolled_back if w.ok else not w.broken
                   for w, a in zip(written, aborts, strict=True))

    if not addresses:
        return GroupResult(False, "AgentUnreachable", "no ready agent to update")
    wrote = False
    try:
        for phase in (agent_pb2.UPDATE_PHASE_PREPARE, agent_pb2.UPDATE_PHASE_PAUSE):
            replies = await stoppable(phase)
            if not all(r.ok for r in replies):
                await each(agent_pb2.UPDATE_PHASE_ABORT)  # nobody switches
                return refused(replies)
        wrote = True
        replies = await stoppable(agent_pb2.UPDATE_PHASE_WRITE)
    except (Stopped, asyncio.CancelledError) as exc:
        # Shielded: a cancelled caller must still leave no engine paused.
        aborts = await asyncio.shield(each(agent_pb2.UPDATE_PHASE_ABORT))
        if isinstance(exc, asyncio.CancelledError):
            raise
        rolled = wrote and any(a.rolled_back for a in aborts)
        return GroupResult(False, STOPPED, "stopped before COMMIT: every node aborted"
                           + (" (written bytes rolled back)" if rolled else ""),
                           broken=not all(a.ok for a in aborts) and wrote)
    if not all(r.ok for r in replies):
        aborts = await each(agent_pb2.UPDATE_PHASE_ABORT)
        bad = next(r for r in replies if not r.ok)
        bad.rolled_back = whole(replies, aborts)
        return refused(replies, broken=not bad.rolled_back)
    if progress is not None:
        progress("COMMIT")
    return await asyncio.shield(_commit(addresses, replies, each, refused, whole))


async def _commit(addresses, written, each, refused, whole) -> GroupResult:
    """The first node commits alone: should it fail, no node switched yet and every node
    rolls back from its host copy (reason RolledBack). The others then commit together; a
    failure among them leaves the group on two generations, which the result names node by
    node (reason PartiallyUpdated): the committed nodes' engines already run the new bytes
    and their daemons no longer hold the old ones."""
    from weightcache.contracts.proto import agent_pb2

    first, rest = addresses[:1], addresses[1:]
    head = await each(agent_pb2.UPDATE_PHASE_COMMIT, first)
    if not head[0].ok:
        aborts = await each(agent_pb2.UPDATE_PHASE_ABORT, rest) if rest else []
        # The first node's agent aborted its own update when the COMMIT failed.
        head[0].rolled_back = (head[0].rolled_back or not head[0].broken) and whole(
            written[1:], aborts)
        return refused(head, broken=not head[0].rolled_back, among=first)
    tail = await each(agent_pb2.UPDATE_PHASE_COMMIT, rest) if rest else []
    replies = head + tail
    committed = {a: r.generation for a, r in zip(addresses, replies, strict=True) if r.ok}
    if len(committed) < len(addresses):
        failed = {a: r.message for a, r in zip(addresses, replies, strict=True) if not r.ok}
        facts = await _serving(list(failed))
        return GroupResult(False, PARTIAL, "; ".join(f"{a}: {m}" for a, m in failed.items()),
                           broken=True, generations=committed,
                           failed={a: facts[a] for a in failed})
    # Every reply carries its node's PREPARE facts: say where no rollback copy was possible.
    no_rollback = next((f"{a}: {r.rollback_why or 'no copy kept'}"
                        for a, r in zip(addresses, replies, strict=True) if not r.rollback), "")
    return GroupResult(True, "Updated", "", generations=committed, no_rollback=no_rollback)


async def _serving(addresses: list[str], timeout_s: float = 5.0) -> dict[str, str]:
    """What each node says it serves now ("unknown" where its agent does not answer)."""
    from weightcache.operator.agentstatus import node_status

    replies = await asyncio.gather(*(node_status(a, timeout_s) for a in addresses))
    return {a: (f"generation {r.generation}" + (f" (revision {r.revision})" if r.revision
                                                  else "")
                if r is not None else "unknown (agent unreachable)")
            for a, r in zip(addresses, replies, strict=True)}
