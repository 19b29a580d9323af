"""What a first install on a real cluster showed: policies where caches live, agents that are not
BestEffort, monitors a kube-prometheus-stack Prometheus selects, and the flags reaching agents."""

from __future__ import annotations

from tests.chart import chart
from tests.chart.conftest import rendered
from weightcache.api.v1alpha1 import WeightCacheSpec, with_defaults
from weightcache.operator import main as operator_main
from weightcache.operator import resources


def _policy_namespaces(docs) -> list[str]:
    return sorted(d["metadata"]["namespace"] for d in chart.by_kind(docs, "NetworkPolicy"))


def test_network_policy_follows_the_watched_namespaces():
    docs = chart.render(sets=["operator.watchNamespaces={llm-a,llm-b}"])
    assert _policy_namespaces(docs) == ["llm-a", "llm-b"]


def test_network_policy_follows_the_caches_of_the_release():
    # values-caches.yaml creates caches in default and inference.
    assert _policy_namespaces(rendered("examples")) == sorted(
        ["default", "inference", chart.NAMESPACE]
    )


def test_explicit_policy_namespaces_win():
    docs = chart.render(
        sets=["operator.watchNamespaces={llm-a}", "agent.networkPolicy.namespaces={x,x,y}"]
    )
    assert _policy_namespaces(docs) == ["x", "y"]


def _notes(*sets: str) -> str:
    args = ["install", "weightcache", str(chart.CHART), "-n", chart.NAMESPACE, "--dry-run=client"]
    for item in sets:
        args += ["--set", item]
    out = chart.helm(*args).stdout
    return " ".join(out[out.index("NOTES:") :].split())


def test_notes_warn_when_caches_may_live_outside_the_policies():
    text = _notes()
    assert "watches all namespaces" in text and "agent.networkPolicy.namespaces" in text
    assert "pod-security.kubernetes.io/enforce=privileged" in text
    assert "watches all namespaces" not in _notes("operator.watchNamespaces={llm}")


def test_agents_get_requests_and_a_priority_class_by_default(default_docs):
    (pc,) = chart.by_kind(default_docs, "PriorityClass")
    assert pc["metadata"]["name"] == "weightcache-agent" and pc["value"] == 1000000
    assert pc["globalDefault"] is False
    container = chart.one(default_docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = operator_main.parser().parse_args(container["args"][1:])
    options = operator_main.options_from_args(args).agent
    assert options.priority_class == "weightcache-agent"
    assert dict(options.requests) == {"cpu": "100m", "memory": "256Mi"}
    # What the operator then writes into the agent DaemonSet:
    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    spec = with_defaults({"runtime": "native", "model": {"path": "/models/m"}}, "ns", "c")
    doc = resources.plan(cache, WeightCacheSpec.from_spec(spec, "ns", "c"), ["n1"], epoch=1)
    pod = resources.daemonset(cache, doc.spec, doc, ["n1"], options)["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "weightcache-agent"
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}


def test_agent_priority_class_and_requests_are_configurable():
    docs = chart.render(
        sets=[
            "agent.priorityClass.name=system-node-critical",
            "agent.resources.requests.cpu=2",
            "agent.resources.requests.memory=",
        ]
    )
    assert not chart.by_kind(docs, "PriorityClass")  # an existing class: none of our own
    container = chart.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    options = operator_main.options_from_args(
        operator_main.parser().parse_args(container["args"][1:])
    ).agent
    assert options.priority_class == "system-node-critical"
    assert dict(options.requests) == {"cpu": "2"}


def test_monitoring_objects_carry_the_selector_label():
    """kube-prometheus-stack selects ServiceMonitors, PodMonitors and PrometheusRules labelled
    `release: <its release>` by default; metrics.selectorLabels puts that label on all three."""
    docs = chart.render(
        api_versions=[chart.PROMETHEUS_API],
        sets=["metrics.selectorLabels.release=kube-prometheus-stack"],
    )
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (obj,) = chart.by_kind(docs, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
        chart.validate(obj)
