"""The chart and the code agree: the operator accepts the flags the chart passes, the
chart's webhook configurations are what the operator's keeper writes, and the agent ports
the NetworkPolicy and PodMonitor name are the ones agent pods expose."""

from __future__ import annotations

import pytest

from tests.chart import chart
from tests.chart.conftest import VALUE_SETS, rendered


def _operator_container(docs):
    dep = chart.one(docs, "Deployment", "-operator")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_accepts_the_chart_flags(name):
    from weightcache.operator import main as operator_main

    container = _operator_container(rendered(name))
    args = container["args"]
    assert args[0] == "operator"
    parsed = operator_main.parser().parse_args(args[1:])
    assert parsed.metrics_port == int(
        next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    )
    assert parsed.health_port == int(
        next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    )
    probe = container["livenessProbe"]["httpGet"]
    assert probe["port"] == "health" and probe["path"] == "/healthz"


def test_replicas_draw_distinct_peering_priorities():
    """Two replicas of equal kopf priority would both pause: each process draws its own."""
    from weightcache.operator import main as operator_main

    container = _operator_container(rendered("default"))
    assert "command" not in container  # the image's entry point, no shell wrapper
    args = operator_main.parser().parse_args(container["args"][1:])
    assert args.peering and args.priority is None
    drawn = {operator_main.replica_priority(args.priority) for _ in range(5)}
    assert len(drawn) > 1 and all(1 <= p <= 1_000_000 for p in drawn)
    assert operator_main.replica_priority(7) == 7


def _keeper_configurations(docs, cert_mode: str):
    from weightcache.operator.admission import config as admission_config

    container = _operator_container(docs)
    from weightcache.operator import main as operator_main

    args = operator_main.parser().parse_args(container["args"][1:])
    cfg = admission_config.AdmissionConfig.from_args(args)
    assert cfg.cert_mode == cert_mode
    return (
        admission_config.mutating_configuration(cfg, None),
        admission_config.validating_configuration(cfg, None),
    )


@pytest.mark.parametrize(
    ("name", "cert_mode"),
    [("default", "self-signed"), ("cert-manager", "cert-manager"), ("production", "cert-manager")],
)
def test_webhook_configurations_equal_what_the_operator_writes(name, cert_mode):
    docs = rendered(name)
    for expected in _keeper_configurations(docs, cert_mode):
        ours = chart.one(docs, expected["kind"])
        assert ours["metadata"]["name"] == expected["metadata"]["name"]
        assert ours["webhooks"] == expected["webhooks"]


def test_webhook_service_and_secret_names_match_the_operator(default_docs):
    from weightcache.operator import main as operator_main
    from weightcache.operator.admission import config as admission_config

    args = operator_main.parser().parse_args(_operator_container(default_docs)["args"][1:])
    cfg = admission_config.AdmissionConfig.from_args(args)
    svc = chart.one(default_docs, "Service", "-webhook")
    assert (svc["metadata"]["name"], svc["metadata"]["namespace"]) == (
        cfg.service_name,
        cfg.namespace,
    )
    assert svc["spec"]["ports"][0]["port"] == cfg.service_port
    container = _operator_container(default_docs)
    webhook_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "webhook")
    assert webhook_port == cfg.port
    assert chart.one(default_docs, "Secret")["metadata"]["name"] == cfg.secret_name
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cfg.cert_dir in mounts


def _agent_daemonset(**spec_extra):
    from weightcache.api.v1alpha1 import WeightCacheSpec
    from weightcache.operator import resources

    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    model = {"path": "/models/m", "volume": {"hostPath": {"path": "/m"}}}
    spec = WeightCacheSpec.from_spec(
        {"runtime": "native", "device": "cpu", "model": model, **spec_extra}, "ns", "c"
    )
    return resources.daemonset(
        cache, spec, resources.plan(cache, spec, ["n1"], 1), ["n1"],
        resources.AgentOptions())


def test_agent_ports_match_the_network_policy_and_pod_monitor():
    ds = _agent_daemonset()
    pod = ds["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    docs = rendered("prometheus-operator")
    policy = chart.one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert {ports["grpc"], ports["metrics"]} == opened
    values = chart.helm("show", "values", str(chart.CHART)).stdout
    for name in ("grpc", "metrics"):
        assert f"{name}: {ports[name]}" in values, (
            f"agent.ports.{name} differs from the CRD default"
        )
    monitor = chart.one(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= set(ports)
    # Agents on other nodes reach each other on any port (rendezvous and collectives).
    assert any(
        "ports" not in rule
        and rule["from"]
        == [{"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}]
        for rule in policy["spec"]["ingress"]
    )


def test_agent_image_flag_reaches_the_daemonset():
    from weightcache.operator import main as operator_main

    container = _operator_container(rendered("production"))
    args = operator_main.parser().parse_args(container["args"][1:])
    options = operator_main.options_from_args(args)
    assert options.agent.image == "registry.example.com/ml/weightcache/agent:0.1.0-cuda"
    assert options.agent.runtime_class == "nvidia"
