"""The native runtime's parallel layouts: the plan the operator writes, the flags the agent
passes to `weightcache preload`, and the ranks the launcher serves must all agree."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent.config import AgentEnv, ConfigError, build_config, parse_plan
from weightcache.agent.runtimes import get_runtime
from weightcache.agent.supervisor import EXIT_CONFIG
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts.layout import Layout
from weightcache.contracts.proto import agent_pb2
from weightcache.native.daemon import launcher as preload
from weightcache.native.engine.attach import attach
from weightcache.native.shared.identity import cpu_identity
from weightcache.operator import resources, spec

SOCK = "/var/run/weightcache/default/llama"


def runtime_for(plan: dict, node_rank: int = 0):
    node = next(n["node"] for n in plan["nodes"] if n["rank"] == node_rank)
    env = AgentEnv(cache="llama", namespace="default", node=node, pod_ip="10.1.2.3",
                   pod_name="llama-agent-x", plan_path="/etc/weightcache/plan.json")
    n = plan["layout"]["worldSize"] // plan["nodeCount"]
    environ = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(n, node_rank)), "PATH": ""}
    return get_runtime(build_config(env, parse_plan(json.dumps(plan)), environ))


def launcher_args(rt) -> list[str]:
    argv = rt.command()
    return argv[argv.index("preload") + 1:]


def operator_plan(parallelism: dict, gpus: int | None = None) -> dict:
    """plan.json exactly as the operator writes it for a native cache."""
    raw = {"runtime": "native", "model": {"path": "/models/llama"}, "parallelism": parallelism}
    if gpus is not None:
        raw["gpusPerNode"] = gpus
    full = WeightCacheSpec.from_spec(raw, "default", "llama")
    assert spec.validate(full) == []
    lay = full.layout()
    cache = {"metadata": {"name": "llama", "namespace": "default", "uid": "u"}}
    written = resources.plan(cache, full, [f"gpu-{i}" for i in range(lay.nodes)], 1)
    return json.loads(resources.configmap(cache, written)["data"]["plan.json"])


@pytest.mark.parametrize(("parallelism", "gpus"), [
    ({"tensor": 4}, None),
    ({"tensor": 16, "nodes": 2}, None),
    ({"tensor": 1, "data": 16, "nodes": 4}, None),
    ({"tensor": 8, "data": 2, "nodes": 4}, None),
    ({"tensor": 2, "data": 2}, None),
    ({"tensor": 2}, 8),  # filler replicas: the operator plans them as DP ranks
], ids=["tp4", "tp16x2nodes", "dp16x4nodes", "tp8dp2x4nodes", "tp2dp2", "tp2-fill8"])
def test_operator_agent_and_launcher_agree(parallelism, gpus):
    plan = operator_plan(parallelism, gpus)
    for node in plan["nodes"]:
        rt = runtime_for(plan, node["rank"])
        args = preload.build_parser().parse_args(launcher_args(rt))
        served = [(p.local, p.global_rank, p.tp_rank, p.dp_rank)
                  for p in Layout.from_args(args).local_ranks()]
        agent = [(r.local_index, r.global_rank, r.tp_rank, r.dp_rank) for r in rt.ranks()]
        # The operator's own view of the group: vLLM's `node_rank * local + i` block.
        local = plan["layout"]["worldSize"] // plan["nodeCount"]
        tp = plan["layout"]["tensor"]
        planned = [(i, g, g % tp, g // tp)
                   for i, g in enumerate(range(node["rank"] * local, (node["rank"] + 1) * local))]
        assert served == planned == agent, node["node"]
        if args.data_parallel_start_rank is not None:
            assert args.data_parallel_start_rank == node["rank"] * local // tp


def test_golden_native_command_lines():
    tail = ["--exit-with-parent", "--weight-cache-socket-dir", SOCK,
            "--weight-cache-health-host", "127.0.0.1", "--weight-cache-health-port", "8478",
            "--device", "cuda", "--dtype", "auto"]
    head = ["--model", "/models/llama", "--tensor-parallel-size"]
    rt = runtime_for(make_plan(runtime="native", tensor=4))
    assert launcher_args(rt) == [*head, "4", *tail]
    rt = runtime_for(make_plan(runtime="native", tensor=16, nodes=2), node_rank=1)
    assert launcher_args(rt) == [*head, "16", "--nnodes", "2", "--node-rank", "1", *tail]
    rt = runtime_for(make_plan(runtime="native", tensor=1, data=16, nodes=4), node_rank=2)
    assert launcher_args(rt) == [
        *head, "1", "--data-parallel-size", "16", "--data-parallel-size-local", "4",
        "--data-parallel-start-rank", "8", "--nnodes", "4", "--node-rank", "2", *tail]
    assert [(r.global_rank, r.tp_rank, r.dp_rank) for r in rt.ranks()] == \
        [(8 + i, 0, 8 + i) for i in range(4)]
    rt = runtime_for(make_plan(runtime="native", tensor=2, data=2))
    assert launcher_args(rt) == [
        *head, "2", "--data-parallel-size", "2", "--data-parallel-size-local", "2",
        "--data-parallel-start-rank", "0", *tail]
    assert rt.environment()["CUDA_VISIBLE_DEVICES"] == ",".join(gpu_uuids(4))


def test_refusals():
    with pytest.raises(ConfigError, match="expert parallelism across data-parallel ranks"):
        runtime_for(make_plan(runtime="native", tensor=1, data=4, expert=True))
    bad = make_plan(runtime="native", tensor=1, data=4, nodes=2)
    bad["layout"]["dataLocal"] = 1  # disagrees with 4 ranks over 2 nodes
    with pytest.raises(ConfigError, match="--data-parallel-size-local: node 0 of 2 holds 2"):
        runtime_for(bad)


def test_native_expert_data_parallel_exits_config(agents, checkpoint):
    plan = make_plan(runtime="native", tensor=1, data=2, expert=True, model=str(checkpoint),
                     spec_extra={"device": "cpu"})
    agent = agents(plan).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert "expert parallelism across data-parallel ranks" in agent.log()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_native_node_rank_1_of_2_serves_global_ranks_2_and_3(agents, checkpoint):
    plan = make_plan(runtime="native", tensor=4, nodes=2, model=str(checkpoint),
                     spec_extra={"device": "cpu"})
    del plan["masterAddr"]  # native ranks need no rendezvous
    agent = agents(plan, node="gpu-b").start()
    st = agent.wait_ready(timeout=90)
    assert (st.node, st.node_rank, st.node_count) == ("gpu-b", 1, 2)
    assert [(r.global_rank, r.tp_rank, r.dp_rank, r.local_index, r.gpu_uuid, r.state)
            for r in st.ranks] == [
        (2, 2, 0, 0, cpu_identity(0), agent_pb2.RANK_STATE_READY),
        (3, 3, 0, 1, cpu_identity(1), agent_pb2.RANK_STATE_READY)]
    # An engine worker of TP rank 2 + i runs on local device i and maps its shard.
    for local in (0, 1):
        tp_rank = 2 + local
        cached = attach(checkpoint, tp_size=4, tp_rank=tp_rank, device_index=local,
                        socket_dir=agent.socket_dir, fallback=False)
        assert cached.source == "cache" and cached.socket == st.ranks[local].socket_path
        assert cached.nbytes == st.ranks[local].bytes
        disk = attach(checkpoint, tp_size=4, tp_rank=tp_rank, device_index=local,
                      socket_dir=agent.sock_root / "none")
        assert disk.source == "disk"
        for name, tensor in disk.state_dict.items():
            assert torch.equal(cached.state_dict[name], tensor), (tp_rank, name)
