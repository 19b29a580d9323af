"""Optional per-node detail from the agents' gRPC Status: bytes cached.

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
    return sum(max(int(rank.bytes), 0) for rank in reply.ranks)


async def group_bytes(addresses: Iterable[str], timeout_s: float = 1.0) -> int | None:
    """Total bytes over agents; None when any agent did not answer (a partial sum misleads)."""
    targets = list(addresses)
    if not targets:
        return None
    results = await asyncio.gather(*(node_bytes(a, timeout_s) for a in targets))
    if any(r is None for r in results):
        return None
    return sum(r for r in results if r is not None)
