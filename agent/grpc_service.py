"""gRPC API of the agent (weightcache/contracts/proto/agent.proto), plus gRPC health.

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
from weightcache.agent.update_rpc import ABORT, ALL, COMMIT, PAUSE, PREPARE, WRITE, AgentUpdater
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
_PHASES = {
    agent_pb2.UPDATE_PHASE_ALL: ALL,
    agent_pb2.UPDATE_PHASE_PREPARE: PREPARE,
    agent_pb2.UPDATE_PHASE_PAUSE: PAUSE,
    agent_pb2.UPDATE_PHASE_COMMIT: COMMIT,
    agent_pb2.UPDATE_PHASE_ABORT: ABORT,
    agent_pb2.UPDATE_PHASE_WRITE: WRITE,
}
MAX_PATH = 4096


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor, alignment: Any = None,
                 warmup: Any = None) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.updater = AgentUpdater(supervisor.runtime)
        self.alignment = alignment  # weightcache.agent.alignment.ReportServer, or None
        self.warmup = warmup  # weightcache.agent.warmup.WarmupState, or None

    def Status(self, request, context):
        snap = self.supervisor.snapshot()
        cfg = self.cfg
        reply = agent_pb2.StatusResponse(
            cache=cfg.env.cache, namespace=cfg.env.namespace, node=cfg.env.node,
            node_rank=cfg.node_rank, node_count=cfg.node_count, epoch=snap.epoch,
            runtime=cfg.plan.runtime, ready=snap.ready, held=snap.held,
            restarts=snap.restarts, version=__version__, message=snap.message,
            generation=self.updater.generation([r.stats for r in snap.ranks]),
            model_path=self.updater.model_path, revision=self.updater.revision,
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
        warm = self.warmup
        if warm is not None:
            with warm.lock:
                out = reply.warmup_cache
                out.path, out.identity, out.unsafe = warm.path, warm.identity, warm.unsafe
                out.bytes = warm.bytes
                out.bytes_by_kind.update(warm.bytes_by_kind)
                out.hits.update(warm.hits)
                out.misses.update(warm.misses)
                if warm.scanned_at:
                    out.scanned_at.FromNanoseconds(int(warm.scanned_at * 1e9))
        for m in self.alignment.recent() if self.alignment is not None else ():
            reply.alignment_misses.add(seq=m.seq, pod=m.pod, result=m.result, detail=m.detail,
                                       missed_ranks=m.missed_ranks)
        return reply

    def Release(self, request, context):
        released, message = self.supervisor.release(request.reason[:256])
        return agent_pb2.ReleaseResponse(released=released, message=message)

    def Update(self, request, context):
        if len(request.model_path) > MAX_PATH or len(request.revision) > 256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_path or revision too long")
        phase = _PHASES.get(request.phase)
        if phase is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown phase {request.phase}")
        out = self.updater.update(
            phase=phase, model_path=request.model_path, revision=request.revision,
            force=request.force, pause_deadline_s=request.pause_deadline_seconds)
        report = out.report or {}
        self.supervisor.refresh_now()  # stats carry the new generation
        return agent_pb2.UpdateResponse(
            ok=out.ok, error=out.error, message=out.message[:1024],
            generation=int(report.get("generation") or 0), revision=self.updater.revision,
            bytes=int(report.get("bytes") or 0),
            seconds_staged=float(report.get("seconds_staged") or 0),
            seconds_paused=float(report.get("seconds_paused") or 0),
            engines_paused=int(report.get("engines_paused") or 0), broken=out.broken,
            tensors=(out.tensors or [])[:16], rollback=bool(report.get("rollback")),
            rollback_why=str(report.get("rollback_why") or "")[:512],
            rolled_back=out.rolled_back)

    def Restart(self, request, context):
        accepted, epoch, message = self.supervisor.restart(request.epoch)
        if not accepted:
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details(message)
        return agent_pb2.RestartResponse(accepted=accepted, epoch=epoch, message=message)


class GrpcServer:
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor, host: str, port: int,
                 alignment: Any = None, warmup: Any = None) -> None:
        self.supervisor = supervisor
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=[("grpc.so_reuseport", 0)])
        agent_pb2_grpc.add_AgentServicer_to_server(
            AgentService(cfg, supervisor, alignment, warmup), self.server)
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
