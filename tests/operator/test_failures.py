"""Failures to converge are visible (status condition + event) and leave no half-built group.

The api_guard fixture answers 422 to every write that breaks an API-server rule; tests here also
make it refuse valid writes, the way a real server's admission plugins or quotas do.
"""

from __future__ import annotations

from tests.chart import rbac_eval
from tests.chart.conftest import rendered
from tests.operator.conftest import NS, eventually
from tests.operator.test_operator import TP16, cm_url, ds_url, phase_is, svc_url
from weightcache import constants as C
from weightcache.operator import podsecurity

EVENTS = f"/api/v1/namespaces/{NS}/events"
POD_SECURITY_DENIAL = (
    'pods "llama-agent-x7k2p" is forbidden: violates PodSecurity "baseline:latest": '
    'hostPath volumes (volumes "sockets", "model")'
)


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions") or []}


async def warning_reasons(cluster) -> set[str]:
    return {
        e.get("reason")
        for e in await cluster.list(EVENTS)
        if e.get("type") == "Warning" and (e.get("involvedObject") or {}).get("kind") == C.KIND
    }


async def test_item4_a_rejected_write_is_reported_and_rolled_back(cluster, api_guard, operator):
    """Item 4: a 422 from the API server reaches status and events; no ConfigMap is left."""
    refused = 'Service "llama-rendezvous" is invalid: spec.ports[0].port: Invalid value'

    def reject_services(method: str, obj: dict) -> str | None:
        return refused if method == "POST" and obj.get("kind") == "Service" else None

    api_guard.reject.append(reject_services)
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    status = await phase_is(cluster, "llama", "Failed")
    ready = conditions(status)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ApplyRejected"
    assert refused in ready["message"] and refused in status["message"]
    assert conditions(status)["Degraded"]["status"] == "True"
    # The event is posted right after the status patch: wait for it, do not race it.
    await eventually(lambda: _has_reason(cluster, "ApplyRejected"))
    # The ConfigMap created before the Service was refused is deleted again: no half group.
    # Every later pass applies the group again and rolls it back again, so the ConfigMap can
    # exist for a moment between one pass's create and its delete (CI caught one there): look
    # once that pass is done.
    await eventually(lambda: _gone(cluster, cm_url("llama")))
    assert await cluster.get(ds_url("llama")) is None

    api_guard.reject.remove(reject_services)  # the cause goes away: the group converges
    await phase_is(cluster, "llama", "Placing")
    for url in (cm_url("llama"), svc_url("llama"), ds_url("llama")):
        assert await cluster.get(url) is not None


async def test_item3_a_name_too_long_for_its_service_is_invalid_without_writes(cluster, operator):
    """Item 3 without the webhook: the operator refuses the name before writing anything."""
    name = "l" * 53  # "<name>-rendezvous" would be 64 characters
    await cluster.add_node("gpu-a")
    await cluster.create_cache(name, {"runtime": "native", "model": {"path": "/models/tiny"}})
    status = await phase_is(cluster, name, "Invalid")
    assert "metadata.name" in status["message"] and "63" in status["message"]
    assert await cluster.get(cm_url(name)) is None
    assert await cluster.get(svc_url(name)) is None


async def test_item4_failed_create_events_of_the_daemonset_reach_status(cluster, operator):
    """Item 4/6: the DaemonSet controller's FailedCreate (here Pod Security) is the cause shown."""
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("llama", TP16)
    await phase_is(cluster, "llama", "Placing")
    ds = C.agent_daemonset_name("llama")
    await cluster.post(
        EVENTS,
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{ds}.17f3a", "namespace": NS},
            "involvedObject": {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "name": ds,
                "namespace": NS,
            },
            "reason": "FailedCreate",
            "type": "Warning",
            "message": f"Error creating: {POD_SECURITY_DENIAL}",
            "lastTimestamp": "2026-12-01T08:00:00Z",
            "source": {"component": "daemonset-controller"},
        },
    )
    status = await phase_is(cluster, "llama", "Failed")
    ready = conditions(status)["Ready"]
    assert ready["reason"] == "PodSecurity"
    assert POD_SECURITY_DENIAL in ready["message"] and ds in ready["message"]
    await eventually(lambda: _has_reason(cluster, "PodSecurity"))

    await cluster.materialize("llama")  # pods appear (e.g. the namespace was relabelled)
    await phase_is(cluster, "llama", "Loading")


async def _has_reason(cluster, reason: str) -> bool:
    return reason in await warning_reasons(cluster)


async def _gone(cluster, url: str) -> bool:
    return await cluster.get(url) is None


async def test_item6_a_baseline_namespace_is_reported_before_pods_are_refused(
    cluster, api_guard, operator
):
    """Item 6: the namespace's enforce label predicts the refusal; status says how to fix it."""
    api_guard.namespaces[NS] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NS, "labels": {podsecurity.ENFORCE_LABEL: "baseline"}},
    }
    await cluster.add_node("gpu-a")
    await cluster.create_cache("tiny", {"runtime": "native", "device": "cpu",
                                        "model": {"path": "/models/tiny"}})  # fmt: skip
    status = await phase_is(cluster, "tiny", "Failed")
    ready = conditions(status)["Ready"]
    assert ready["reason"] == "PodSecurity"
    assert "enforces Pod Security level 'baseline'" in ready["message"]
    assert f"{podsecurity.ENFORCE_LABEL}=privileged" in ready["message"]
    assert status["podSecurity"] == "baseline"
    # The group is still applied, so relabelling the namespace is all it takes.
    assert await cluster.get(ds_url("tiny")) is not None
    await eventually(lambda: _has_reason(cluster, "PodSecurity"))


def assert_chart_rbac_allows_every_operator_request(kmock) -> set[tuple[str, str]]:
    """kmock ignores RBAC: judge every request the operator sent by the chart's ClusterRole."""
    roles = [d for d in rendered("default") if d["kind"] in ("ClusterRole", "Role")]
    roles = [r for r in roles if r["metadata"]["name"].endswith("-operator")]
    made = set()
    for request in list(kmock):
        agent = str(request.headers.get("User-Agent", ""))
        if agent.startswith("kmock/"):
            continue  # the test's own requests
        attrs = rbac_eval.attributes(request.method.value, request.url.path, request.params)
        if attrs is not None:
            made.add(attrs)
    denied = sorted(str(a) for a in made if not rbac_eval.allowed(a, roles))
    assert not denied, denied
    return {(a.verb, a.resource) for a in made}


async def test_pod_security_detection_needs_only_the_charts_rbac(cluster, api_guard, operator):
    """The namespace read and the DaemonSet event list are granted by the chart's role."""
    api_guard.namespaces[NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    await cluster.add_node("gpu-a")
    await cluster.create_cache(
        "tiny", {"runtime": "native", "device": "cpu", "model": {"path": "/models/tiny"}}
    )
    await phase_is(cluster, "tiny", "Placing")
    used = assert_chart_rbac_allows_every_operator_request(cluster.kmock)
    assert {("get", "namespaces"), ("list", "events"), ("create", "daemonsets")} <= used
