"""Model revision changes through the real kopf operator against kmock, agents over real gRPC.

The agents here are stand-ins served by grpcio on loopback (one per node, 127.0.0.1 and
127.0.0.2) that answer the Update RPC as the real agent does (tests/agent/test_update_rpc.py
runs the real one against real daemons). What is asserted is the operator's part: in place by
default for runtime native, all nodes through PREPARE -> PAUSE -> WRITE -> COMMIT with ABORT
everywhere on a refusal, no pod recreated, status and events; Recreate (and runtime vllm, whose
weight-cache daemon has no update command in vllm/model_executor/model_loader/weight_cache/
daemon.py of vLLM 0.33.0) restarts the group instead.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.operator.conftest import NS, cache_url, eventually, running_operator
from tests.operator.test_operator import cm_url, ds_url, phase_is
from weightcache import constants as C
from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc

PHASES = {v: k for k, v in agent_pb2.UpdatePhase.items()}


class Agent(agent_pb2_grpc.AgentServicer):
    """Answers like the real agent: a layout that differs is refused at PREPARE."""

    def __init__(self, refuse: str) -> None:
        self.calls: list[tuple[str, str]] = []
        self.generation = 1
        self.refuse = refuse
        self.unpausable = 0  # PAUSE refusals left (an engine that cannot pause right now)
        self.failing_commit = "\0"  # COMMIT of a path containing this fails (rolled back here)
        self.wrote = False

    async def Status(self, request, context):
        return agent_pb2.StatusResponse(cache="llama", ready=True, generation=self.generation)

    async def Update(self, request, context):
        phase = PHASES[request.phase].removeprefix("UPDATE_PHASE_")
        self.calls.append((phase, request.model_path))
        if phase in ("PREPARE", "ALL") and self.refuse in request.model_path:
            return agent_pb2.UpdateResponse(
                ok=False, error="layout_mismatch", tensors=["model.embed_tokens.weight"],
                message="1 tensors differ from the cached layout (a restart is needed)")
        if phase == "PAUSE" and self.unpausable:
            self.unpausable -= 1
            return agent_pb2.UpdateResponse(ok=False, error="unpausable_engine",
                                            message="engine pid 4242 did not pause")
        if phase == "WRITE":
            self.wrote = True
        if phase == "ABORT":  # like the real agent: written bytes go back from the host copy
            wrote, self.wrote = self.wrote, False
            return agent_pb2.UpdateResponse(ok=True, rolled_back=wrote)
        if phase == "COMMIT" and self.failing_commit in request.model_path:
            self.wrote = False
            return agent_pb2.UpdateResponse(ok=False, error="broken", rolled_back=True,
                                            message="rank 0: the daemon closed the connection")
        if phase in ("COMMIT", "ALL"):
            self.generation += 1
            self.wrote = False
        return agent_pb2.UpdateResponse(ok=True, generation=self.generation,
                                        revision=request.revision)


@pytest.fixture
async def agents():
    started, port = [], 0
    # node gpu-a refuses nothing; gpu-b refuses "bad-layout" (only one node sees the problem).
    for host, refuse in (("127.0.0.1", "\0"), ("127.0.0.2", "bad-layout")):
        servicer = Agent(refuse)
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        started.append((server, servicer))
    yield port, [s for _, s in started]
    for server, _ in started:
        await server.stop(None)


def spec(port: int, **extra) -> dict:
    return {"runtime": "native", "model": {"path": "/models/a"},
            "parallelism": {"tensor": 16, "nodes": 2}, "ports": {"grpc": port}, **extra}


async def ready_group(cluster, body: dict) -> None:
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", body)
    await phase_is(cluster, "llama", "Placing")
    pods = await cluster.materialize("llama", ready=True, ip="127.0.0.1")
    for pod in pods:  # one loopback address per node
        ip = "127.0.0.1" if pod["spec"]["nodeName"] == "gpu-a" else "127.0.0.2"
        await cluster.patch(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                            {"status": {"podIP": ip}})
    await phase_is(cluster, "llama", "Ready")


async def updating(cluster, reason: str) -> dict:
    async def check():
        status = await cluster.status("llama")
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Updating"), None)
        return status if cond and cond["reason"] == reason else None

    return await eventually(check)


async def _posted(cluster, reason: str) -> bool:
    """Events are posted after the status patch they report: poll, do not race them."""
    return reason in await reasons(cluster)


async def reasons(cluster) -> list[str]:
    return [e.get("reason") for e in await cluster.list(f"/api/v1/namespaces/{NS}/events")]


async def _observed(cluster, generation: int) -> bool:
    return (await cluster.status("llama")).get("observedGeneration") == generation


def plan_hash(ds: dict) -> str:
    return ds["spec"]["template"]["metadata"]["annotations"]["weightcache.io/plan-hash"]


async def test_revision_change_updates_in_place_node_by_node(cluster, operator, agents):
    port, (a, b) = agents
    await ready_group(cluster, spec(port))
    status = await cluster.status("llama")
    assert status["model"] == {"path": "/models/a", "revision": ""}
    assert [n["generation"] for n in status["nodes"]] == [1, 1]
    before_hash = plan_hash(await cluster.get(ds_url("llama")))
    pods = sorted(p["metadata"]["name"] for p in await cluster.agent_pods("llama"))

    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2}, "spec": {
        "model": {"path": "/models/b", "revision": "step-200"}}})
    status = await updating(cluster, "Updated")
    cond = next(c for c in status["conditions"] if c["type"] == "Updating")
    assert cond["status"] == "False" and "generation 2" in cond["message"]
    assert status["model"] == {"path": "/models/b", "revision": "step-200"}
    assert [(n["generation"], n["revision"]) for n in status["nodes"]] == [(2, "step-200")] * 2
    # One barrier: every node staged before any paused, paused before any wrote, wrote before
    # any switched.
    for agent in (a, b):
        assert agent.calls == [("PREPARE", "/models/b"), ("PAUSE", "/models/b"),
                               ("WRITE", "/models/b"), ("COMMIT", "/models/b")]
    # In place: no agent pod recreated, the plan follows (a restarting agent loads /models/b).
    assert plan_hash(await cluster.get(ds_url("llama"))) == before_hash
    assert sorted(p["metadata"]["name"] for p in await cluster.agent_pods("llama")) == pods
    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["spec"]["model"]["path"] == "/models/b"
    await eventually(lambda: _posted(cluster, "Updated"))

    # A layout only node gpu-b can see differs: refused everywhere, old revision serves.
    a.calls.clear(), b.calls.clear()
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 3}, "spec": {
        "model": {"path": "/models/bad-layout", "revision": "x"}}})
    status = await updating(cluster, "LayoutMismatch")
    cond = next(c for c in status["conditions"] if c["type"] == "Updating")
    assert "model.embed_tokens.weight" in cond["message"]
    assert "still serving /models/b@step-200" in cond["message"]
    assert status["model"] == {"path": "/models/b", "revision": "step-200"}
    assert status["phase"] == "Ready"
    assert ("ABORT", "/models/bad-layout") in a.calls and ("COMMIT", "") not in a.calls
    assert not any(phase == "COMMIT" for phase, _ in a.calls + b.calls)
    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["spec"]["model"]["path"] == "/models/b"
    await eventually(lambda: _posted(cluster, "LayoutMismatch"))

    # Only the strategy changes: nothing to restart for (the pod template stays as it is).
    before_template = (await cluster.get(ds_url("llama")))["spec"]["template"]
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 4}, "spec": {
        "model": {"path": "/models/b", "revision": "step-200"},
        "updateStrategy": {"type": "Recreate"}}})
    await eventually(lambda: _observed(cluster, 4))
    assert (await cluster.get(ds_url("llama")))["spec"]["template"] == before_template
    # The refusal of /models/bad-layout does not outlive the revert to the served revision.
    cond = update_cond(await cluster.status("llama"))
    assert cond["reason"] == "Serving" and "was LayoutMismatch" in cond["message"], cond
    assert sorted(p["metadata"]["name"] for p in await cluster.agent_pods("llama")) == pods

    # Recreate: the group restarts under a new epoch, the DaemonSet rolls its pods.
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 5}, "spec": {
        "model": {"path": "/models/c"}, "updateStrategy": {"type": "Recreate"}}})
    status = await updating(cluster, "Recreated")
    # (a merge patch keeps revision "step-200")
    assert status["model"] == {"path": "/models/c", "revision": "step-200"}
    after = (await cluster.get(ds_url("llama")))["spec"]["template"]["metadata"]["annotations"]
    assert int(after[C.ANN_EPOCH]) == int(
        before_template["metadata"]["annotations"][C.ANN_EPOCH]) + 1
    await eventually(lambda: _posted(cluster, "Recreating"))


async def test_vllm_revision_change_recreates_and_says_why(cluster, operator):
    body = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0",
            "model": {"path": "/models/a"}, "parallelism": {"tensor": 8}}
    await cluster.add_node("gpu-a")
    await cluster.create_cache("llama", body)
    await phase_is(cluster, "llama", "Placing")
    before = plan_hash(await cluster.get(ds_url("llama")))
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2},
                                             "spec": {"model": {"path": "/models/b"}}})
    status = await updating(cluster, "Recreated")
    cond = next(c for c in status["conditions"] if c["type"] == "Updating")
    assert "runtime vllm cannot update in place" in cond["message"]
    assert plan_hash(await cluster.get(ds_url("llama"))) != before


def update_cond(status: dict) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == "Updating"), None)


async def test_refused_update_survives_an_unschedulable_pass(cluster, operator, agents):
    """An Unschedulable pass must not turn a refused update into the served revision."""
    port, (a, b) = agents
    await ready_group(cluster, spec(port))
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2}, "spec": {
        "model": {"path": "/models/bad-layout", "revision": "x"}}})
    status = await updating(cluster, "LayoutMismatch")
    assert status["model"] == {"path": "/models/a", "revision": ""}
    refused = update_cond(status)

    await cluster.set_node_ready("gpu-b", False)
    status = await phase_is(cluster, "llama", "Unschedulable")
    assert status["model"] == {"path": "/models/a", "revision": ""}
    assert update_cond(status)["reason"] == "LayoutMismatch"

    a.calls.clear(), b.calls.clear()
    await cluster.set_node_ready("gpu-b", True)
    status = await phase_is(cluster, "llama", "Ready")
    assert status["model"] == {"path": "/models/a", "revision": ""}
    assert update_cond(status) == refused
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "Progressing", "Degraded", "Updating"}
    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["spec"]["model"]["path"] == "/models/a"
    # Not retried for the same target, and never committed.
    assert not any(phase == "COMMIT" for phase, _ in a.calls + b.calls)


async def test_plan_write_refused_after_an_update_still_reports_it(
        cluster, api_guard, operator, agents):
    """The daemons committed: a refused plan write must not lose that (no second update)."""
    port, (a, b) = agents
    await ready_group(cluster, spec(port))
    refused: list[str] = []

    def reject_plan_once(method: str, obj: dict) -> str | None:
        plan = (obj.get("data") or {}).get(C.PLAN_KEY) if obj.get("kind") == "ConfigMap" else None
        if (not refused and method == "PATCH" and plan
                and json.loads(plan)["spec"]["model"]["path"] == "/models/b"):
            refused.append(method)
            return "ConfigMap is invalid: refused once by the test"
        return None

    api_guard.reject.append(reject_plan_once)
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2}, "spec": {
        "model": {"path": "/models/b", "revision": "step-200"}}})
    status = await updating(cluster, "Updated")
    assert refused
    assert status["model"] == {"path": "/models/b", "revision": "step-200"}

    async def plan_follows():
        plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
        return plan["spec"]["model"]["path"] == "/models/b"

    await eventually(plan_follows)
    status = await phase_is(cluster, "llama", "Ready")
    assert [(n["generation"], n["revision"]) for n in status["nodes"]] == [(2, "step-200")] * 2
    for agent in (a, b):  # one update, not re-sent by the next pass
        assert agent.calls == [("PREPARE", "/models/b"), ("PAUSE", "/models/b"),
                               ("WRITE", "/models/b"), ("COMMIT", "/models/b")]
    await eventually(lambda: _posted(cluster, "ApplyRejected"))


async def test_a_passing_refusal_is_retried_a_refused_layout_is_not(cluster, agents):
    """An engine that could not pause is asked again after the backoff (and the update goes
    through); a layout the cache cannot take is never retried for the same target."""
    port, (a, b) = agents
    async with running_operator(update_retry_s=1.0):
        await ready_group(cluster, spec(port))
        b.unpausable = 1
        await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2}, "spec": {
            "model": {"path": "/models/b", "revision": "step-200"}}})
        await eventually(lambda: _posted(cluster, "EngineCannotPause"))
        status = await updating(cluster, "Updated")
        assert status["model"] == {"path": "/models/b", "revision": "step-200"}
        assert b.calls.count(("PAUSE", "/models/b")) == 2  # refused once, then the retry

        a.calls.clear(), b.calls.clear()
        await cluster.patch(cache_url("llama"), {"metadata": {"generation": 3}, "spec": {
            "model": {"path": "/models/bad-layout", "revision": "x"}}})
        await updating(cluster, "LayoutMismatch")
        await asyncio.sleep(3.5)  # three backoffs and several resyncs
        assert b.calls.count(("PREPARE", "/models/bad-layout")) == 1


async def test_the_first_node_commits_alone_and_its_failure_rolls_every_node_back(
        cluster, operator, agents):
    """gpu-a (rank 0) fails its COMMIT: gpu-b, which wrote too, never gets a COMMIT; it is
    aborted (its host copy goes back) and the group keeps the old revision whole."""
    port, (a, b) = agents
    a.failing_commit = "commit-fails"
    await ready_group(cluster, spec(port))
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": 2}, "spec": {
        "model": {"path": "/models/commit-fails", "revision": "c"}}})
    status = await updating(cluster, "RolledBack")
    cond = next(c for c in status["conditions"] if c["type"] == "Updating")
    assert "127.0.0.1" in cond["message"] and "every node was rolled back" in cond["message"]
    assert "still serving /models/a@" in cond["message"]
    assert a.calls[-1] == ("COMMIT", "/models/commit-fails")
    assert [phase for phase, _ in b.calls] == ["PREPARE", "PAUSE", "WRITE", "ABORT"]
    assert status["model"] == {"path": "/models/a", "revision": ""}
    assert [n["generation"] for n in status["nodes"]] == [1, 1]
