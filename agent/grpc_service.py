"""gRPC API of the agent (agent/proto/agent.proto) plus the standard gRPC health service.

Health service names: "" and "weightcache.agent.v1.Agent" and "readiness" are SERVING only
when every local rank is ready (kubelet readiness probe, operator); "liveness" is SERVING
while the supervisor runs (kubelet liveness probe).
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from weightcache import __version__
from weightcache.agent.config import AgentConfig
from weightcache.agent.supervisor import State, Supervisor
from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger("weightcache.agent.grpc")
SERVICE = "weightcache.agent.v1.Agent"
READINESS_NAMES = ("", SERVICE, "readiness")
LIVENESS_NAME = "liveness"
_STATES = {
    State.PENDING: agent_pb2.RANK_STATE_PENDING,
    State.LOADING: agent_pb2.RANK_STATE_LOADING,
    State.READY: agent_pb2.RANK_STATE_READY,
    State.FAILED: agent_pb2.RANK_STATE_FAILED,
    State.RELEASED: agent_pb2.RANK_STATE_RELEASED,
}


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor, alignment: Any = None) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.alignment = alignment  # weightcache.agent.alignment.ReportServer, or None

    def Status(self, request, context):
        snap = self.supervisor.snapshot()
        cfg = self.cfg
        reply = agent_pb2.StatusResponse(
            cache=cfg.env.cache, namespace=cfg.env.namespace, node=cfg.env.node,
            node_rank=cfg.node_rank, node_count=cfg.node_count, epoch=snap.epoch,
            runtime=cfg.plan.runtime, ready=snap.ready, held=snap.held,
            restarts=snap.restarts, version=__version__, message=snap.message,
        )
        for r in snap.ranks:
            since = Timestamp()
            since.FromNanoseconds(int(r.since * 1e9))
            s = r.spec
            reply.ranks.add(
                role=s.role, global_rank=s.global_rank, tp_rank=s.tp_rank, dp_rank=s.dp_rank,
                local_index=s.local_index, gpu_uuid=s.device.uuid, socket_path=s.socket_path,
                state=_STATES[r.state], bytes=r.bytes, pid=r.pid, since=since, message=r.message,
            )
        for m in self.alignment.recent() if self.alignment is not None else ():
            reply.alignment_misses.add(seq=m.seq, pod=m.pod, result=m.result, detail=m.detail,
                                       missed_ranks=m.missed_ranks)
        return reply

    def Release(self, request, context):
        released, message = self.supervisor.release(request.reason[:256])
        return agent_pb2.ReleaseResponse(released=released, message=message)

    def Restart(self, request, context):
        accepted, epoch, message = self.supervisor.restart(request.epoch)
        if not accepted:
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details(message)
        return agent_pb2.RestartResponse(accepted=accepted, epoch=epoch, message=message)


class GrpcServer:
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor, host: str, port: int,
                 alignment: Any = None) -> None:
        self.supervisor = supervisor
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=[("grpc.so_reuseport", 0)])
        agent_pb2_grpc.add_AgentServicer_to_server(AgentService(cfg, supervisor, alignment),
                                                  self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self.server.add_insecure_port(target)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC on {target}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot bind gRPC on {target}")
        self.port = bound
        self.update_health()

    def start(self) -> None:
        self.server.start()

    def update_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        ready = self.supervisor.ready()
        for name in READINESS_NAMES:
            self.health.set(name, serving if ready else not_serving)
        self.health.set(LIVENESS_NAME, serving if self.supervisor.alive else not_serving)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=2).wait(5)
