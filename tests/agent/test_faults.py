"""Bad input and faults: each gives a clear log line, a status/metric, and the right exit code."""

from __future__ import annotations

import re
import socket

import pytest

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent.supervisor import EXIT_CONFIG, EXIT_DAEMON, EXIT_PORT, EXIT_RUNTIME


def vllm_env(vllm_bin: str, n: int = 1, **extra: str) -> dict[str, str]:
    return {"WEIGHTCACHE_VLLM_BIN": vllm_bin, "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(n)),
            **extra}


def test_malformed_configmap(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin))
    agent.plan_path.write_text('{"cache": "llama", "runtime": ')
    assert agent.start().wait_exit() == EXIT_CONFIG
    assert "configuration refused: plan: not valid JSON" in agent.log()


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda p: p["layout"].update(worldSize=3), "layout.worldSize 3 != tensor 1 x data 1"),
    (lambda p: p.update(runtime="sglang"), "runtime must be one of native, vllm"),
    (lambda p: p["nodes"].append({"node": "gpu-x", "rank": 5}), "must be exactly 0..0"),
    (lambda p: p["spec"]["parallelism"].update(pipeline=2), "pipeline parallelism"),
])
def test_invalid_plan_fields(agents, vllm_bin, mutate, message):
    plan = make_plan()
    mutate(plan)
    agent = agents(plan, env=vllm_env(vllm_bin)).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert message in agent.log()


def test_plan_of_another_cache(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin, WEIGHTCACHE_CACHE_NAME="other")).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert "wrong ConfigMap mounted" in agent.log()


def test_node_not_in_plan(agents, vllm_bin):
    agent = agents(make_plan(), node="gpu-z", env=vllm_env(vllm_bin)).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert "node 'gpu-z' is not in the placement plan of default/llama" in agent.log()


def test_not_enough_gpus(agents, vllm_bin):
    agent = agents(make_plan(tensor=4), env=vllm_env(vllm_bin, 2)).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert "2 usable GPU(s) but the plan needs 4 local rank(s)" in agent.log()


def test_runtime_binary_missing(agents, tmp_path):
    agent = agents(make_plan(), env=vllm_env(str(tmp_path / "no-such-vllm"))).start()
    assert agent.wait_exit() == EXIT_RUNTIME
    assert "binary" in agent.log() and "not found or not executable" in agent.log()


def test_grpc_port_in_use(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", agent.ports["grpc"]))
        busy.listen()
        assert agent.start().wait_exit() == EXIT_PORT
    assert f"gRPC port 127.0.0.1:{agent.ports['grpc']} unavailable" in agent.log()


def test_daemon_health_port_in_use(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin), args=["--max-load-failures", "2",
                                                                "--backoff", "0.1"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", agent.ports["health"]))
        busy.listen()
        assert agent.start().wait_exit() == EXIT_DAEMON
    assert f"health port {agent.ports['health']} is in use" in agent.log()
    assert "failed 2 times in a row" in agent.log()


def test_socket_dir_not_writable(agents, vllm_bin, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    plan = make_plan()
    agent = agents(plan, env=vllm_env(vllm_bin, WEIGHTCACHE_AGENT_SOCKET_DIR=f"{blocker}/s"))
    assert agent.start().wait_exit() == EXIT_RUNTIME
    assert f"socket dir {blocker}/s is not writable" in agent.log()


def test_child_exits_during_load_native(agents, tmp_path):
    plan = make_plan(runtime="native", tensor=1, model=str(tmp_path / "missing-model"),
                     spec_extra={"device": "cpu"})
    # The backoff is the window in which the first status showing the restart must land (polls
    # every 0.1 s): 4 s, not 1.5, so that a status call slowed by a loaded machine still does.
    agent = agents(plan, args=["--max-load-failures", "2", "--backoff", "4"]).start()
    st = agent.wait(lambda s: s.restarts >= 1, timeout=60)
    assert st.ranks[0].state == 4  # FAILED while waiting for the backoff
    assert "daemon launcher exited with code 2" in st.ranks[0].message
    assert "restarting in 4s" in st.message
    assert agent.wait_exit(timeout=60) == EXIT_DAEMON
    log = agent.log()
    assert "daemon launcher exited with code 2" in log
    assert "daemons failed 2 times in a row without becoming ready" in log


def test_child_hangs_past_load_timeout(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin, FAKE_VLLM_LOAD_S="600"),
                   args=["--load-timeout", "1.5", "--max-load-failures", "1"]).start()
    st = agent.wait(lambda s: s.ranks and s.ranks[0].state == 2, timeout=30)
    assert not st.ready
    assert agent.wait_exit(timeout=60) == EXIT_DAEMON
    assert "load did not finish within 1.5s" in agent.log()


def test_bad_reply_never_ready(agents, vllm_bin):
    agent = agents(make_plan(), env=vllm_env(vllm_bin, FAKE_VLLM_REPLY="evil"),
                   args=["--load-timeout", "2", "--max-load-failures", "1"]).start()
    st = agent.wait(lambda s: "refusing to load global" in s.ranks[0].message, timeout=30)
    assert not st.ready
    code, body = agent.http("/metrics")
    assert code == 200 and re.search(r'weightcache_agent_ready\{cache="llama",[^}]*\} 0.0', body)
    assert agent.wait_exit(timeout=60) == EXIT_DAEMON


def test_conflicting_extra_args(agents, vllm_bin):
    plan = make_plan(engine_args={"extraArgs": ["--load-format", "ipc_cache"]})
    agent = agents(plan, env=vllm_env(vllm_bin)).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert "extraArgs sets --load-format" in agent.log()
