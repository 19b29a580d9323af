"""The vllm runtime against a stand-in `vllm preload` that serves vLLM's frames on real sockets."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.agent.harness import FAKE_VLLM
from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent import vllm_probe
from weightcache.agent.runtimes.base import socket_is_ours
from weightcache.contracts.proto import agent_pb2

PWNED = Path("/tmp/weightcache-fake-vllm-pwned")


def rank_pids(socket_path: str) -> list[int]:
    """Pids of stand-in rank servers bound to `socket_path` (found through /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--rank-server" in cmd and socket_path.encode() in cmd:
            found.append(int(entry))
    return found


def test_multi_node_rank_kill_is_held_until_new_epoch(agents, vllm_bin, tmp_path):
    args_out = tmp_path / "argv.json"
    plan = make_plan(tensor=4, nodes=2, epoch=7)
    agent = agents(plan, node="gpu-b", env={
        "WEIGHTCACHE_VLLM_BIN": vllm_bin, "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(2, 1)),
        "FAKE_VLLM_ARGS_OUT": str(args_out)}).start()
    st = agent.wait_ready(timeout=60)
    ports = agent.ports
    assert json.loads(args_out.read_text()) == [
        "preload", "--model", "/models/llama", "--tensor-parallel-size", "4",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "llama-rendezvous.default.svc",
        "--weight-cache-master-port", str(ports["rendezvous"]),
        "--weight-cache-socket-dir", agent.socket_dir, "--weight-cache-health-host", "127.0.0.1",
        "--weight-cache-health-port", str(ports["health"])]
    assert (st.node_rank, st.node_count, st.epoch) == (1, 2, 7)
    assert [(r.global_rank, r.tp_rank, r.gpu_uuid, r.bytes) for r in st.ranks] == [
        (2, 2, gpu_uuids(2, 1)[0], 1 << 20), (3, 3, gpu_uuids(2, 1)[1], 1 << 20)]
    assert st.ranks[1].socket_path == vllm_probe.socket_path(agent.socket_dir, gpu_uuids(2, 1)[1])
    launcher = st.ranks[0].pid

    victim = rank_pids(st.ranks[1].socket_path)
    assert len(victim) == 1
    os.kill(victim[0], signal.SIGKILL)
    st = agent.wait(lambda s: s.held, timeout=30)
    assert not st.ready and st.restarts == 0
    assert [r.state for r in st.ranks] == [agent_pb2.RANK_STATE_READY,
                                           agent_pb2.RANK_STATE_FAILED]
    assert "watch connection closed" in st.ranks[1].message
    assert agent.http("/readyz")[0] == 503
    time.sleep(1.5)  # the agent must not restart alone
    st = agent.status()
    assert st.held and st.restarts == 0 and st.ranks[0].pid == launcher

    stub = agent.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Restart(agent_pb2.RestartRequest(epoch=6), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reply = stub.Restart(agent_pb2.RestartRequest(epoch=8), timeout=5)
    assert reply.accepted and reply.epoch == 8
    st = agent.wait(lambda s: s.ready and s.epoch == 8, timeout=60)
    assert not st.held and st.ranks[0].pid != launcher and st.restarts == 1

    # Release stops the daemons but keeps the agent; Restart brings them back.
    assert stub.Release(agent_pb2.ReleaseRequest(reason="scale down"), timeout=30).released
    st = agent.status()
    assert not st.ready
    assert all(r.state == agent_pb2.RANK_STATE_RELEASED for r in st.ranks)
    assert not any(os.path.exists(r.socket_path) for r in st.ranks)
    assert stub.Restart(agent_pb2.RestartRequest(epoch=8), timeout=5).accepted
    agent.wait_ready(timeout=60)
    assert agent.terminate() == 0


def test_readiness_waits_for_sockets_and_draft_group(agents, vllm_bin):
    spec_cfg = {"method": "eagle3", "model": "/models/eagle3", "num_speculative_tokens": 2}
    plan = make_plan(tensor=2, engine_args={"speculativeConfig": spec_cfg})
    agent = agents(plan, env={"WEIGHTCACHE_VLLM_BIN": vllm_bin, "FAKE_VLLM_LOAD_S": "2",
                              "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(2))}).start()
    st = agent.wait(lambda s: len(s.ranks) == 4
                    and all(r.state == agent_pb2.RANK_STATE_LOADING for r in s.ranks), 30)
    assert not st.ready
    assert agent.http("/readyz")[0] == 503 and agent.http("/healthz")[0] == 200
    health = health_pb2_grpc.HealthStub(agent.channel())
    check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    st = agent.wait_ready(timeout=60)
    assert [(r.role, r.global_rank) for r in st.ranks] == [
        ("target", 0), ("target", 1), ("draft", 0), ("draft", 1)]
    assert all(r.socket_path.endswith("_draft.sock") for r in st.ranks[2:])
    assert agent.http("/readyz")[0] == 200
    assert agent.terminate() == 0
    assert not any(os.path.exists(r.socket_path) for r in st.ranks)


@pytest.fixture
def rank_server():
    """Start one stand-in rank server on a real socket in a private directory."""
    started = []
    root = tempfile.mkdtemp(prefix="wcp", dir="/tmp")

    def start(reply: str = "", uuid: str = "GPU-0000aaaa-1111") -> str:
        sock_dir = os.path.join(root, "s")
        os.makedirs(sock_dir, mode=0o700, exist_ok=True)
        path = vllm_probe.socket_path(sock_dir, uuid)
        env = {**os.environ, "FAKE_VLLM_REPLY": reply}
        proc = subprocess.Popen([sys.executable, str(FAKE_VLLM), "--rank-server", path, "4096"],
                                env=env)
        started.append(proc)
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        return path

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
    subprocess.run(["rm", "-rf", root], check=False)


def test_probe_get_memory_and_watch(rank_server):
    path = rank_server()
    assert socket_is_ours(path, os.path.dirname(path)) is None
    assert vllm_probe.get_memory(path) == 4096
    watcher = vllm_probe.watch(path)
    readable, _, _ = select.select([watcher], [], [], 0.2)
    assert not readable
    for pid in rank_pids(path):
        os.kill(pid, signal.SIGKILL)
    readable, _, _ = select.select([watcher], [], [], 5)
    assert readable and watcher.recv(1) == b""
    watcher.close()


def test_probe_refuses_pickled_globals(rank_server):
    PWNED.unlink(missing_ok=True)
    path = rank_server("evil")
    with pytest.raises(vllm_probe.ProbeError, match="refusing to load global"):
        vllm_probe.get_memory(path)
    assert not PWNED.exists()


@pytest.mark.parametrize(("reply", "match"), [("huge", "exceeds"), ("error", "'error'")])
def test_probe_bounded_and_status_checked(rank_server, reply, match):
    path = rank_server(reply)
    with pytest.raises(vllm_probe.ProbeError, match=match):
        vllm_probe.get_memory(path)


def test_socket_ownership_checks(rank_server, tmp_path):
    path = rank_server()
    sock_dir = os.path.dirname(path)
    link = os.path.join(sock_dir, "link.sock")
    os.symlink(path, link)
    assert "symlink" in socket_is_ours(link, sock_dir)
    assert "outside" in socket_is_ours(path, str(tmp_path))
    os.chmod(sock_dir, 0o755)
    try:
        assert "must be private" in socket_is_ours(path, sock_dir)
    finally:
        os.chmod(sock_dir, 0o700)
    assert socket_is_ours(os.path.join(sock_dir, "absent.sock"), sock_dir) == \
        "socket not bound yet"


def test_launcher_does_not_outlive_a_killed_agent(agents, vllm_bin):
    agent = agents(make_plan(tensor=1), env={
        "WEIGHTCACHE_VLLM_BIN": vllm_bin, "NVIDIA_VISIBLE_DEVICES": gpu_uuids(1)[0]}).start()
    st = agent.wait_ready(timeout=60)
    launcher, ranks = st.ranks[0].pid, rank_pids(st.ranks[0].socket_path)
    assert len(ranks) == 1
    agent.proc.kill()
    agent.proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (os.path.exists(f"/proc/{launcher}")
                                           or os.path.exists(f"/proc/{ranks[0]}")):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{launcher}") and not os.path.exists(f"/proc/{ranks[0]}")
