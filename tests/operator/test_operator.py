"""The real kopf operator against kmock: create, readiness, churn, re-placement, updates, delete."""

from __future__ import annotations

import json

from tests.operator.conftest import NS, eventually
from weightcache import constants as C
from weightcache.contracts.plan import Plan

TP16 = {
    "runtime": "vllm",
    "image": "vllm/vllm-openai:v0.31.0",
    "model": {"path": "/models/llama-70b"},
    "parallelism": {"tensor": 16, "nodes": 2},
}


def ds_url(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/daemonsets/{C.agent_daemonset_name(name)}"


def svc_url(name: str) -> str:
    return f"/api/v1/namespaces/{NS}/services/{C.rendezvous_service_name(name)}"


def cm_url(name: str) -> str:
    return f"/api/v1/namespaces/{NS}/configmaps/{C.placement_configmap_name(name)}"


async def reconciled(ctl, rounds: int = 2) -> None:
    """Wait until the reconciler has run `rounds` more times (it runs on every node event)."""
    target = ctl.reconciles + rounds

    async def check():
        return ctl.reconciles >= target

    await eventually(check)


async def phase_is(cluster, name, phase):
    async def check():
        status = await cluster.status(name)
        return status if status.get("phase") == phase else None

    return await eventually(check)


async def test_create_builds_owned_objects(cluster, operator):
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    status = await phase_is(cluster, "llama", "Placing")
    assert [(n["node"], n["rank"]) for n in status["nodes"]] == [("gpu-a", 0), ("gpu-b", 1)]
    assert status["epoch"] == 1 and status["ranks"] == "0/16"
    assert status["observedGeneration"] == 1
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Progressing"]["status"] == "True"
    assert conditions["Ready"]["status"] == "False"

    cache = await cluster.cache("llama")
    assert cache["metadata"]["finalizers"] == [f"{C.GROUP}/finalizer"]
    uid = cache["metadata"]["uid"]

    ds = await cluster.get(ds_url("llama"))
    owner = ds["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("WeightCache", uid, True)
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostIPC"] is True  # stock vLLM IPC
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # One term per node: the API server takes one value per matchFields requirement
    # (validateNodeFieldSelectorRequirement); the api_guard fixture rejects anything else.
    assert [t["matchFields"] for t in terms["nodeSelectorTerms"]] == [
        [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}],
        [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}],
    ]
    agent = pod["containers"][0]
    assert agent["image"] == "vllm/vllm-openai:v0.31.0"
    assert "nvidia.com/gpu" not in json.dumps(agent.get("resources", {}))
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env[C.ENV_NODE_NAME] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env[C.ENV_PLAN] == C.DEFAULT_PLAN_PATH
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["sockets"] == f"/var/run/weightcache/{NS}/llama"
    assert mounts["plan"] == "/etc/weightcache"
    assert ds["spec"]["template"]["metadata"]["annotations"][C.ANN_EPOCH] == "1"
    assert C.LABEL_NODE_RANK not in ds["spec"]["template"]["metadata"]["labels"]

    svc = await cluster.get(svc_url("llama"))
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"][C.LABEL_NODE_RANK] == "0"
    assert [p["port"] for p in svc["spec"]["ports"]] == [29600, 29601]

    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["masterAddr"] == f"llama-rendezvous.{NS}.svc"
    assert [(n["node"], n["rank"]) for n in plan["nodes"]] == [("gpu-a", 0), ("gpu-b", 1)]
    ranks = Plan.from_doc(plan).local_ranks(1)
    assert [r.global_rank for r in ranks] == list(range(8, 16))
    assert plan["layout"]["worldSize"] == 16 and plan["epoch"] == 1 and plan["uid"] == uid

    events = await cluster.list(f"/api/v1/namespaces/{NS}/events")
    assert "Placed" in {e.get("reason") for e in events}
    # Pods are watched with a server-side selector: other pods never reach the operator.
    pod_watches = [r for r in cluster.kmock if r.url.path == f"/api/v1/namespaces/{NS}/pods"]
    assert pod_watches
    assert {r.params.get("labelSelector") for r in pod_watches} == {
        "app.kubernetes.io/name=weightcache-agent"
    }


async def test_readiness_drives_status_pod_ranks_and_node_labels(cluster, operator):
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    await phase_is(cluster, "llama", "Placing")
    await cluster.materialize("llama", ready=False)
    status = await phase_is(cluster, "llama", "Loading")
    assert status["ranks"] == "0/16"

    async def ranked():
        pods = await cluster.agent_pods("llama")
        labels = {
            p["spec"]["nodeName"]: p["metadata"]["labels"].get(C.LABEL_NODE_RANK) for p in pods
        }
        return labels if labels == {"gpu-a": "0", "gpu-b": "1"} else None

    await eventually(ranked)

    await cluster.set_pods_ready("llama")
    status = await phase_is(cluster, "llama", "Ready")
    assert status["ranksReady"] == 16 and status["readyNodes"] == 2
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Seeding": "True",  # a vLLM cache of world size > 1 serves seeds (docs/warmup.md)
    }
    key = C.node_ready_label(NS, "llama")

    async def labelled():
        nodes = [await cluster.get(f"/api/v1/nodes/{n}") for n in ("gpu-a", "gpu-b")]
        return all(n["metadata"]["labels"].get(key) == "ready" for n in nodes)

    await eventually(labelled)
    async def reported() -> bool:  # the Ready event follows the status patch
        events = {e.get("reason") for e in await cluster.list(f"/api/v1/namespaces/{NS}/events")}
        return {"Placed", "Loading", "Ready"} <= events

    await eventually(reported)

    # One member's agent stops being ready: a multi-node group restarts as a whole.
    pods = await cluster.agent_pods("llama")
    await cluster.patch(
        f"/api/v1/namespaces/{NS}/pods/{pods[0]['metadata']['name']}",
        {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
    )

    async def restarted():
        ds = await cluster.get(ds_url("llama"))
        return ds["spec"]["template"]["metadata"]["annotations"][C.ANN_EPOCH] == "2"

    await eventually(restarted)

    async def unlabelled():
        nodes = [await cluster.get(f"/api/v1/nodes/{n}") for n in ("gpu-a", "gpu-b")]
        return all(key not in n["metadata"].get("labels", {}) for n in nodes)

    await eventually(unlabelled)
    status = await cluster.status("llama")
    assert status["epoch"] == 2 and status["phase"] in ("Placing", "Loading")


async def test_ranks_survive_churn_and_lost_node_replaces_group(cluster, operator):
    for n in ("gpu-b", "gpu-c", "gpu-d"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    status = await phase_is(cluster, "llama", "Placing")
    assert [n["node"] for n in status["nodes"]] == ["gpu-b", "gpu-c"]
    await cluster.materialize("llama", ready=True)
    await phase_is(cluster, "llama", "Ready")

    # Unrelated churn: a node that sorts first joins, a spare leaves. Nothing moves.
    await cluster.add_node("gpu-a")
    await cluster.delete("/api/v1/nodes/gpu-d")
    await cluster.add_node("gpu-e")
    await reconciled(operator)
    status = await cluster.status("llama")
    assert [n["node"] for n in status["nodes"]] == ["gpu-b", "gpu-c"]
    assert status["epoch"] == 1 and status["phase"] == "Ready"

    # A placed node goes NotReady: its rank moves to a spare, the group restarts.
    await cluster.set_node_ready("gpu-b", False)

    async def replaced():
        st = await cluster.status("llama")
        return st if st.get("epoch") == 2 else None

    status = await eventually(replaced)
    assert [(n["node"], n["rank"]) for n in status["nodes"]] == [("gpu-a", 0), ("gpu-c", 1)]
    ds = await cluster.get(ds_url("llama"))
    assert ds["spec"]["template"]["metadata"]["annotations"][C.ANN_EPOCH] == "2"
    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["epoch"] == 2 and plan["nodes"][0]["node"] == "gpu-a"
    events = {e.get("reason") for e in await cluster.list(f"/api/v1/namespaces/{NS}/events")}
    assert "Replaced" in events


async def test_spec_update_rolls_the_group(cluster, operator):
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    await phase_is(cluster, "llama", "Placing")
    await cluster.materialize("llama", ready=True)
    await phase_is(cluster, "llama", "Ready")
    before = (await cluster.get(ds_url("llama")))["spec"]["template"]["metadata"]["annotations"]

    await cluster.patch(
        f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}/llama",
        {"metadata": {"generation": 2}, "spec": {"engineArgs": {"dtype": "bfloat16"}}},
    )

    async def rolled():
        ds = await cluster.get(ds_url("llama"))
        ann = ds["spec"]["template"]["metadata"]["annotations"]
        return (
            ann if ann["weightcache.io/plan-hash"] != before["weightcache.io/plan-hash"] else None
        )

    after = await eventually(rolled)
    assert after[C.ANN_EPOCH] == before[C.ANN_EPOCH]  # same placement, new plan
    plan = json.loads((await cluster.get(cm_url("llama")))["data"][C.PLAN_KEY])
    assert plan["spec"]["engineArgs"]["dtype"] == "bfloat16"
    # The old pods no longer count: the group is loading again until new pods are ready.
    status = await phase_is(cluster, "llama", "Loading")
    assert status["observedGeneration"] == 2
    await cluster.materialize("llama", ready=True)
    await phase_is(cluster, "llama", "Ready")


async def test_delete_removes_everything(cluster, operator):
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    await phase_is(cluster, "llama", "Placing")
    await cluster.materialize("llama", ready=True)
    await phase_is(cluster, "llama", "Ready")
    key = C.node_ready_label(NS, "llama")

    async def labelled():
        return (await cluster.get("/api/v1/nodes/gpu-a"))["metadata"]["labels"].get(key)

    await eventually(labelled)
    await cluster.delete(f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}/llama")

    async def gone():
        return await cluster.cache("llama") is None

    await eventually(gone)
    assert await cluster.get(ds_url("llama")) is None
    assert await cluster.get(svc_url("llama")) is None
    assert await cluster.get(cm_url("llama")) is None
    for n in ("gpu-a", "gpu-b"):
        assert key not in (await cluster.get(f"/api/v1/nodes/{n}"))["metadata"].get("labels", {})
    # The warmup directory: one cleanup Job per node that held the cache (operator/cleanup.py;
    # runtime vllm has no daemon state directory).
    jobs = await cluster.list(f"/apis/batch/v1/namespaces/{NS}/jobs")
    jobs = [j for j in jobs if j["metadata"]["labels"].get("weightcache.io/cleanup") == "llama"]
    assert sorted(j["spec"]["template"]["spec"]["nodeName"] for j in jobs) == ["gpu-a", "gpu-b"]
    warm = f"/var/cache/weightcache/{NS}/llama"
    for j in jobs:
        pod = j["spec"]["template"]["spec"]
        assert pod["volumes"] == [{"name": "parent-0", "hostPath": {
            "path": f"/var/cache/weightcache/{NS}", "type": "Directory"}}]
        empty, remove = pod["initContainers"][0], pod["containers"][0]
        assert empty["command"][-1] == warm and remove["command"][-1] == warm
        assert empty["securityContext"]["runAsUser"] == 1000
        assert remove["securityContext"]["runAsUser"] == 0
        for c in (empty, remove):
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert j["spec"]["ttlSecondsAfterFinished"] > 0
        assert "ownerReferences" not in j["metadata"]  # outlives its cache until the TTL
    from tests.operator.test_failures import assert_chart_rbac_allows_every_operator_request

    used = assert_chart_rbac_allows_every_operator_request(cluster.kmock)
    assert ("create", "jobs") in used


async def test_invalid_spec_is_reported_not_built(cluster, operator):
    await cluster.add_node("gpu-a")
    spec = {**TP16, "parallelism": {"tensor": 3, "nodes": 2}, "image": "vllm/vllm-openai:latest"}
    await cluster.create_cache("bad", spec)
    status = await phase_is(cluster, "bad", "Invalid")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Degraded"]["reason"] == "InvalidSpec"
    assert "spec.parallelism.nodes" in status["message"]
    assert "spec.image" in status["message"] and "pin" in status["message"]
    assert await cluster.get(ds_url("bad")) is None
    assert await cluster.get(cm_url("bad")) is None
    events = await cluster.list(f"/api/v1/namespaces/{NS}/events")
    assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events)


async def test_not_enough_nodes_is_unschedulable_with_counts(cluster, operator):
    await cluster.add_node("gpu-a")
    await cluster.add_node("small", gpus=4)
    await cluster.add_node("down", ready=False)
    await cluster.create_cache("big", TP16)
    await phase_is(cluster, "big", "Unschedulable")

    async def counted_every_node():
        # The operator may place before its node index has seen all three nodes; a node
        # arriving later re-runs placement, and the message then counts it.
        status = await cluster.status("big")
        progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
        message = progressing["message"]
        return progressing if "1 NotEnoughGPUs" in message and "1 NotReady" in message else None

    progressing = await eventually(counted_every_node)
    assert (progressing["status"], progressing["reason"]) == ("False", "Unschedulable")
    assert "need 2 eligible nodes, found 1 (1 missing)" in progressing["message"]
    assert await cluster.get(ds_url("big")) is None
    # A second suitable node appears: the cache is placed.
    await cluster.add_node("gpu-b")
    status = await phase_is(cluster, "big", "Placing")
    assert [n["node"] for n in status["nodes"]] == ["gpu-a", "gpu-b"]


async def test_drift_is_repaired_and_native_cpu_needs_no_host_namespaces(cluster, operator):
    await cluster.add_node("cpu-a", gpus=0)
    spec = {"runtime": "native", "device": "cpu", "model": {"path": "/models/tiny"}}
    await cluster.create_cache("tiny", spec)
    await phase_is(cluster, "tiny", "Placing")
    ds = await cluster.get(ds_url("tiny"))
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is False and pod["hostIPC"] is False
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert pod["containers"][0]["image"].startswith("weightcache/agent:")

    # Someone edits the owned DaemonSet and deletes the Service: both come back.
    await cluster.patch(ds_url("tiny"), {"spec": {"template": {"spec": {"hostPID": True}}}})
    await cluster.delete(svc_url("tiny"))

    async def repaired():
        ds = await cluster.get(ds_url("tiny"))
        svc = await cluster.get(svc_url("tiny"))
        return svc is not None and ds["spec"]["template"]["spec"]["hostPID"] is False

    await eventually(repaired, timeout=10)


async def test_restarted_operator_resumes_without_reshuffling(cluster):
    from tests.operator.conftest import running_operator

    for n in ("gpu-b", "gpu-c"):
        await cluster.add_node(n)
    async with running_operator():
        await cluster.create_cache("llama", TP16)
        await phase_is(cluster, "llama", "Placing")
        await cluster.materialize("llama", ready=True)
        await phase_is(cluster, "llama", "Ready")
    # While no operator runs, a node that sorts first joins the fleet.
    await cluster.add_node("gpu-a")
    async with running_operator() as ctl:
        await reconciled(ctl, 2)
        status = await cluster.status("llama")
        assert [n["node"] for n in status["nodes"]] == ["gpu-b", "gpu-c"]
        assert status["epoch"] == 1 and status["phase"] == "Ready"
        ds = await cluster.get(ds_url("llama"))
        assert ds["spec"]["template"]["metadata"]["annotations"][C.ANN_EPOCH] == "1"


async def test_peering_lets_one_replica_reconcile(cluster):
    from tests.operator.conftest import running_operator

    cluster.kmock.resources["kopf.dev/v1/clusterkopfpeerings"] = cluster.kmock.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs={"get", "list", "watch", "patch"}
    )
    cluster.kmock.resources["kopf.dev/v1/kopfpeerings"] = cluster.kmock.ResourceInfo(
        kind="KopfPeering", namespaced=True, verbs={"get", "list", "watch", "patch"}
    )
    await cluster.post(
        f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings",
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": "weightcache", "namespace": NS, "resourceVersion": "1"},
        },
    )
    await cluster.add_node("gpu-a")
    peering = ("--peering", "weightcache")
    async with (
        running_operator(extra=(*peering, "--priority", "100")) as leader,
        running_operator(extra=(*peering, "--priority", "10")) as standby,
    ):
        await cluster.create_cache("small", {"runtime": "native", "model": {"path": "/models/m"}})
        await phase_is(cluster, "small", "Placing")
        await reconciled(leader, 2)
        assert leader.reconciles >= 2 and standby.reconciles == 0


async def test_nodes_are_labelled_loading_while_the_agents_load_then_ready(cluster, operator):
    """Scale-up overlaps: an engine may be scheduled where the cache is still loading."""
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    await phase_is(cluster, "llama", "Placing")
    key = C.node_ready_label(NS, "llama")

    async def values() -> dict:
        nodes = [await cluster.get(f"/api/v1/nodes/{n}") for n in ("gpu-a", "gpu-b")]
        return {n["metadata"]["name"]: n["metadata"]["labels"].get(key) for n in nodes}

    assert set((await values()).values()) == {None}  # no agent pod runs yet: no label
    await cluster.materialize("llama", ready=False)  # agent pods run, ranks loading

    async def loading():
        got = await values()
        return got if got == {"gpu-a": "loading", "gpu-b": "loading"} else None

    await eventually(loading)
    await cluster.set_pods_ready("llama")
    await phase_is(cluster, "llama", "Ready")

    async def ready():
        got = await values()
        return got if got == {"gpu-a": "ready", "gpu-b": "ready"} else None

    await eventually(ready)
    await cluster.delete(f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}/llama")

    async def unlabelled():
        return set((await values()).values()) == {None}

    await eventually(unlabelled)
