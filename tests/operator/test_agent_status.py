"""bytesCached comes from the agents' real gRPC Status service (optional detail)."""

from __future__ import annotations

import grpc

from tests.operator.conftest import eventually
from tests.operator.test_operator import phase_is
from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc
from weightcache.operator import agentstatus

GIB = 1 << 30


class FakeAgent(agent_pb2_grpc.AgentServicer):
    """A stand-in node agent: 8 ready ranks of 2 GiB each."""

    async def Status(self, request, context):
        ranks = [
            agent_pb2.Rank(global_rank=i, state=agent_pb2.RANK_STATE_READY, bytes=2 * GIB)
            for i in range(8)
        ]
        return agent_pb2.StatusResponse(cache="llama", ready=True, ranks=ranks)


async def _server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServicer_to_server(FakeAgent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_group_bytes_sums_agents_and_refuses_partial_sums():
    server, port = await _server()
    try:
        assert await agentstatus.node_bytes(f"127.0.0.1:{port}", 1.0) == 16 * GIB
        assert await agentstatus.group_bytes([f"127.0.0.1:{port}"] * 2) == 32 * GIB
        # An agent that does not answer: no total rather than a misleading one.
        assert await agentstatus.group_bytes([f"127.0.0.1:{port}", "127.0.0.1:1"], 0.5) is None
    finally:
        await server.stop(None)


async def test_status_reports_bytes_from_ready_agents(cluster, operator):
    server, port = await _server()
    try:
        for n in ("gpu-a", "gpu-b"):
            await cluster.add_node(n)
        spec = {
            "runtime": "native",
            "model": {"path": "/models/m"},
            "parallelism": {"tensor": 16, "nodes": 2},
            "ports": {"grpc": port},
        }
        await cluster.create_cache("llama", spec)
        await phase_is(cluster, "llama", "Placing")
        await cluster.materialize("llama", ready=True, ip="127.0.0.1")

        async def cached():
            status = await cluster.status("llama")
            return status if status.get("bytesCached") == 32 * GIB else None

        status = await eventually(cached)
        assert status["phase"] == "Ready"
    finally:
        await server.stop(None)
