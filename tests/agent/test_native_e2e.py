"""The agent with the native runtime on CPU, end to end: real daemon processes, real sockets,
gRPC, HTTP health, promtool and a real Prometheus server scraping the agent."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.agent.plans import make_plan
from weightcache.contracts.proto import agent_pb2
from weightcache.native.shared import protocol
from weightcache.native.shared.identity import cpu_identity

REPO = Path(__file__).resolve().parents[2]


def shard_bytes(ckpt: Path, tp: int) -> list[int]:
    from weightcache.native.shared.checkpoint import open_checkpoint, tied_aliases
    from weightcache.native.shared.loader import plan_layout
    from weightcache.native.shared.sharding import parse_rules

    c = open_checkpoint(str(ckpt))
    aliases = tied_aliases(c)
    return [plan_layout(c, rules=parse_rules(None), tp_size=tp, tp_rank=r, dtype="auto",
                        aliases=aliases).nbytes for r in range(tp)]


def hello(path: str) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        protocol.send_frame(s, {"cmd": "hello"})
        reply, _ = protocol.recv_frame(s)
    return reply


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def attach(ckpt: Path, socket_dir: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "attach", "--model", str(ckpt),
         "--tensor-parallel-size", "2", "--rank", "0", "--device", "cpu",
         "--weight-cache-socket-dir", socket_dir, *extra],
        capture_output=True, text=True, timeout=120, cwd="/")


def health_status(stub, service: str, want: int = 1, timeout: float = 5.0) -> int:
    """The service's health status, waiting briefly for `want` (updates are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        if status == want or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_native_agent_end_to_end(agents, checkpoint, prometheus):
    plan = make_plan(runtime="native", tensor=2, model=str(checkpoint), epoch=4,
                     spec_extra={"device": "cpu"})
    agent = agents(plan).start()
    st = agent.wait_ready(timeout=90)

    # gRPC Status: identity of the node and every rank's detail.
    expected = shard_bytes(checkpoint, 2)
    assert (st.cache, st.namespace, st.node, st.node_rank, st.node_count, st.epoch, st.runtime) \
        == ("llama", "default", "gpu-a", 0, 1, 4, "native")
    assert st.ready and not st.held and st.restarts == 0
    assert [(r.global_rank, r.tp_rank, r.dp_rank, r.role, r.state) for r in st.ranks] == [
        (0, 0, 0, "target", agent_pb2.RANK_STATE_READY),
        (1, 1, 0, "target", agent_pb2.RANK_STATE_READY)]
    assert [r.bytes for r in st.ranks] == expected
    assert [r.gpu_uuid for r in st.ranks] == [cpu_identity(0), cpu_identity(1)]
    assert [r.socket_path for r in st.ranks] == [
        f"{agent.socket_dir}/{cpu_identity(i)}.sock" for i in range(2)]
    launcher = st.ranks[0].pid
    assert launcher > 0 and st.ranks[1].pid == launcher
    assert all(r.since.seconds > 0 for r in st.ranks)
    rank_pids = [hello(r.socket_path)["pid"] for r in st.ranks]

    # HTTP and gRPC health.
    assert agent.http("/healthz")[0] == 200
    assert agent.http("/readyz")[0] == 200
    hstub = health_pb2_grpc.HealthStub(agent.channel())
    for service in ("", "weightcache.agent.v1.Agent", "readiness", "liveness"):
        assert health_status(hstub, service) == health_pb2.HealthCheckResponse.SERVING, service

    # Engines attach: one match, one dtype mismatch (falls back to disk).
    ok = attach(checkpoint, agent.socket_dir)
    assert ok.returncode == 0, ok.stderr
    mismatch = attach(checkpoint, agent.socket_dir, "--dtype", "float32")
    assert mismatch.returncode == 0, mismatch.stderr

    # The exposition is valid for promtool.
    code, text = agent.http("/metrics")
    assert code == 200
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text,
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr

    # A real Prometheus scrapes the agent; PromQL sees the expected series.
    prom = prometheus([agent.metrics_target])
    ready = prom.wait_for('weightcache_rank_ready{cache="llama"} == 1', lambda r: len(r) == 2)
    assert sorted((m["metric"]["rank"], m["metric"]["gpu_uuid"], m["metric"]["role"],
                   m["metric"]["node"]) for m in (x for x in ready)) == [
        ("0", cpu_identity(0), "target", "gpu-a"), ("1", cpu_identity(1), "target", "gpu-a")]
    assert value(prom.query('sum(weightcache_cached_bytes{cache="llama"})')) == sum(expected)
    assert value(prom.query('weightcache_agent_ready{cache="llama"}')) == 1
    info = prom.query("weightcache_build_info")
    assert info[0]["metric"]["runtime"] == "native"
    assert value(prom.query('weightcache_daemon_restarts_total{cache="llama"}')) == 0
    loads = prom.query('weightcache_load_duration_seconds{cache="llama"}')
    assert len(loads) == 2 and all(float(m["value"][1]) > 0 for m in loads)
    prom.wait_for('sum(weightcache_daemon_requests_total{command="get_state",result="ok"})',
                  lambda r: bool(r) and float(r[0]["value"][1]) >= 1)
    prom.wait_for('sum(weightcache_daemon_requests_total{command="get_state",result="mismatch"})',
                  lambda r: bool(r) and float(r[0]["value"][1]) >= 1)
    prom.wait_for('weightcache_fingerprint_mismatches_total{field="dtype"}',
                  lambda r: bool(r) and float(r[0]["value"][1]) >= 1)
    prom.wait_for('weightcache_attach_duration_seconds_count{cache="llama"}',
                  lambda r: bool(r) and float(r[0]["value"][1]) >= 1)
    attached = prom.query("weightcache_engines_attached")
    assert len(attached) == 2 and all(float(m["value"][1]) == 0 for m in attached)

    # Rank kill on a single-node group: reported, then the group is restarted.
    os.kill(rank_pids[1], signal.SIGKILL)
    st = agent.wait(lambda s: s.restarts >= 1 and s.ready, timeout=90)
    assert st.ranks[0].pid != launcher
    assert "rank 1" in agent.log() and "exited" in agent.log()
    assert gone(launcher)
    prom.wait_for('weightcache_daemon_restarts_total{cache="llama"}',
                  lambda r: bool(r) and float(r[0]["value"][1]) == 1)
    new_pids = [hello(r.socket_path)["pid"] for r in st.ranks]

    # SIGTERM: every rank stops and every socket is gone.
    assert agent.terminate() == 0
    for pid in (st.ranks[0].pid, *new_pids):
        assert gone(pid), pid
    for r in st.ranks:
        assert not os.path.exists(r.socket_path)
    assert "agent stopped (exit 0)" in agent.log()
    with pytest.raises(grpc.RpcError):
        agent.status()


def test_a_stopped_rank_is_not_ready_within_seconds_and_restarted(agents, checkpoint):
    """A SIGSTOPped rank keeps its socket and its watch connection open, so only a ping
    tells it apart: Status, /readyz and weightcache_rank_ready say not ready within seconds
    and the group is restarted by the policy of a dead rank."""
    plan = make_plan(runtime="native", tensor=2, model=str(checkpoint), epoch=1,
                     spec_extra={"device": "cpu"})
    agent = agents(plan).start()
    st = agent.wait_ready(timeout=90)
    pids = [hello(r.socket_path)["pid"] for r in st.ranks]
    os.kill(pids[0], signal.SIGSTOP)
    try:
        stopped = agent.wait(lambda s: not s.ready, timeout=30)
        assert stopped.ranks[0].state != agent_pb2.RANK_STATE_READY
        assert agent.http("/readyz")[0] == 503
        _, text = agent.http("/metrics")
        assert any(ln.startswith("weightcache_rank_ready{") and 'rank="0"' in ln
                   and ln.endswith(" 0.0") for ln in text.splitlines()), text
        st = agent.wait(lambda s: s.restarts >= 1 and s.ready, timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGCONT)
    assert "does not answer" in agent.log()
    assert gone(pids[0])
    assert [hello(r.socket_path)["pid"] for r in st.ranks] != pids
    assert agent.terminate() == 0


def test_status_shows_bytes_loaded_while_ranks_load(agents, checkpoint):
    """While ranks hold loaded shards unbound, Status is LOADING with their bytes so far (from
    the launcher's /health), so a long load is seen moving; READY then keeps the bytes."""
    from weightcache.native.daemon.config import BIND_DELAY_ENV

    plan = make_plan(runtime="native", tensor=2, model=str(checkpoint), epoch=1,
                     spec_extra={"device": "cpu"})
    agent = agents(plan, env={BIND_DELAY_ENV: "4"}).start()
    expected = shard_bytes(checkpoint, 2)
    st = agent.wait(lambda s: len(s.ranks) == 2 and all(
        r.state == agent_pb2.RANK_STATE_LOADING and r.bytes > 0 for r in s.ranks), 60)
    assert [r.bytes for r in st.ranks] == expected and not st.ready
    st = agent.wait_ready(timeout=60)
    assert [r.bytes for r in st.ranks] == expected
