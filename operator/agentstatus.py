"""Optional per-node detail from the agents' gRPC Status: bytes cached, alignment misses.

Readiness always comes from the agent pods' Ready condition (kubelet runs the gRPC health
probe), so status stays correct when this probe cannot reach an agent. The probe only adds
`bytesCached`: the calls run concurrently with a short deadline, and a node that does not
answer contributes None. The caller then keeps the last known total.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


async def node_bytes(address: str, timeout_s: float) -> int | None:
    """Bytes held by the ranks of one agent (`host:port`), or None when it does not answer."""
    reply = await node_status(address, timeout_s)
    return None if reply is None else sum(max(int(rank.bytes), 0) for rank in reply.ranks)


async def node_status(address: str, timeout_s: float):
    """One agent's gRPC StatusResponse, or None when it does not answer."""
    try:
        import grpc

        from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc
    except ImportError:  # an operator image without the agent's gRPC modules
        return None
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            reply = await stub.Status(agent_pb2.StatusRequest(), timeout=timeout_s)
    except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
        logger.debug("agent %s status unavailable: %s", address, exc)
        return None
    return reply


async def group_bytes(addresses: Iterable[str], timeout_s: float = 1.0) -> int | None:
    """Total bytes over agents; None when any agent did not answer (a partial sum misleads)."""
    return (await group_status(addresses, timeout_s))[0]


async def group_status(
    addresses: Iterable[str], timeout_s: float = 1.0
) -> tuple[int | None, dict[str, list]]:
    """(total bytes as `group_bytes`, each answering agent's `alignment_misses`)."""
    targets = list(addresses)
    if not targets:
        return None, {}
    replies = await asyncio.gather(*(node_status(a, timeout_s) for a in targets))
    misses = {a: list(r.alignment_misses) for a, r in zip(targets, replies, strict=True) if r}
    if any(r is None for r in replies):
        return None, misses
    return sum(max(int(k.bytes), 0) for r in replies for k in r.ranks), misses
