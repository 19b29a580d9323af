"""Engine alignment misses reported by agents become Warning events on the engine pods.

The agent side is a real gRPC servicer answering the real proto; the operator is the real kopf
operator against kmock. The agent's own half (reports in, `alignment_misses` out) is covered
in tests/agent/test_alignment_agent.py.
"""

from __future__ import annotations

import grpc

from tests.operator.conftest import eventually
from tests.operator.test_operator import phase_is
from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc
from weightcache.operator import alignment_events

MISS = agent_pb2.AlignmentMiss(
    seq=1, pod="engine-7f9c", result="partial", missed_ranks=1,
    detail="rank 0 (tp_rank 0) on GPU-05 holding tp_rank 1",
)


class MissingAgent(agent_pb2_grpc.AgentServicer):
    async def Status(self, request, context):
        ranks = [agent_pb2.Rank(global_rank=i, state=agent_pb2.RANK_STATE_READY, bytes=1)
                 for i in range(8)]
        return agent_pb2.StatusResponse(cache="llama", ready=True, ranks=ranks,
                                        alignment_misses=[MISS])


def test_unseen_counts_each_miss_once_and_survives_agent_restarts() -> None:
    seen: dict[str, int] = {}
    first = [MISS, agent_pb2.AlignmentMiss(seq=2, pod="b")]
    assert [m.seq for m in alignment_events.unseen(seen, "a:1", first)] == [1, 2]
    assert alignment_events.unseen(seen, "a:1", first) == []
    restarted = [agent_pb2.AlignmentMiss(seq=1, pod="c")]
    assert [m.pod for m in alignment_events.unseen(seen, "a:1", restarted)] == ["c"]


async def test_operator_posts_one_event_per_miss_on_the_pod(cluster, operator):
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServicer_to_server(MissingAgent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await cluster.add_node("gpu-a")
        spec = {"runtime": "native", "model": {"path": "/models/m"},
                "parallelism": {"tensor": 2}, "gpusPerNode": 8, "ports": {"grpc": port}}
        await cluster.create_cache("llama", spec)
        await phase_is(cluster, "llama", "Placing")
        await cluster.materialize("llama", ready=True, ip="127.0.0.1")

        async def posted():
            items = await cluster.list("/api/v1/namespaces/default/events")
            found = [e for e in items if e.get("reason") == alignment_events.REASON]
            return found or None

        found = await eventually(posted)
        event = found[0]
        assert event["type"] == "Warning"
        assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod",
                                           "name": "engine-7f9c", "namespace": "default"}
        assert "rank 0 (tp_rank 0) on GPU-05 holding tp_rank 1" in event["message"]
        assert "WeightCache llama: GPU alignment partial, 1 rank(s)" in event["message"]
        await phase_is(cluster, "llama", "Ready")
        items = await cluster.list("/api/v1/namespaces/default/events")
        assert len([e for e in items if e.get("reason") == alignment_events.REASON]) == 1
    finally:
        await server.stop(None)
