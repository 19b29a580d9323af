"""Who reaches an agent's ports under the chart's NetworkPolicy, evaluated with the
NetworkPolicy semantics of networking.k8s.io/v1 (rules are ORed; a rule without `ports`
admits every port, one without `from` every source; a peer with only a podSelector means
pods of the policy's own namespace). The seed channel is unencrypted (vLLM 0.33 seed.py),
so its ports must admit agent pods of the same namespace and nobody else."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart import chart
from tests.chart.conftest import rendered
from weightcache import constants
from weightcache.api.v1alpha1 import Ports

AGENT = {constants.LABEL_APP: constants.AGENT_APP, constants.LABEL_CACHE: "old"}
ENGINE = {"app": "vllm-engine", constants.LABEL_CACHE: "old"}


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    sel = selector or {}
    assert not sel.get("matchExpressions"), "extend the evaluator"
    return all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())


def _peer(peer: dict[str, Any], policy_ns: str, ns: str, labels: dict[str, str]) -> bool:
    assert "ipBlock" not in peer, "extend the evaluator"
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns})
    else:
        ns_ok = ns == policy_ns
    return ns_ok and _selects(peer.get("podSelector"), labels)


def _port(rule_port: dict[str, Any], port: int) -> bool:
    first = rule_port["port"]
    return first <= port <= rule_port.get("endPort", first)


def admitted(policy: dict[str, Any], ns: str, labels: dict[str, str], port: int) -> bool:
    policy_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        if peers is not None and not any(_peer(p, policy_ns, ns, labels) for p in peers):
            continue
        ports = rule.get("ports")
        if ports is not None and not any(_port(p, port) for p in ports):
            continue
        return True
    return False


@pytest.mark.parametrize("values", ["default", "production"])
def test_seed_ports_admit_only_agents_of_the_same_namespace(values):
    for policy in chart.by_kind(rendered(values), "NetworkPolicy"):
        ns = policy["metadata"]["namespace"]
        assert _selects(policy["spec"]["podSelector"], AGENT)
        # The whole block a source may listen on (ports.seed + rank, draft block after).
        for port in (Ports().seed, Ports().seed + 255, Ports().seed + 511):
            assert admitted(policy, ns, AGENT, port), (ns, port)
            assert not admitted(policy, ns, ENGINE, port), "an engine pod of the namespace"
            assert not admitted(policy, "elsewhere", AGENT, port), "an agent of another ns"
            assert not admitted(policy, ns, {}, port), "any other pod"
        # The controls: the evaluator admits what the policy opens wider (metrics to the
        # scrapers) and refuses what it keeps to the operator (gRPC).
        assert admitted(policy, "monitoring", {"app.kubernetes.io/name": "prometheus"},
                        Ports().metrics)
        assert not admitted(policy, ns, ENGINE, Ports().grpc)


def test_the_evaluator_catches_a_policy_that_opens_the_seed_ports_wider(default_docs):
    """The test above can fail: a rule for agents of any namespace (namespaceSelector {}) or
    one without `from` would admit what it must not."""
    import copy

    policy = chart.one(default_docs, "NetworkPolicy")
    ns, seed = policy["metadata"]["namespace"], Ports().seed
    wide = copy.deepcopy(policy)
    for rule in wide["spec"]["ingress"]:
        for peer in rule.get("from") or []:
            if "namespaceSelector" not in peer:
                peer["namespaceSelector"] = {}
    assert admitted(wide, "elsewhere", AGENT, seed)
    open_rule = copy.deepcopy(policy)
    open_rule["spec"]["ingress"].append({"ports": [{"port": seed, "endPort": seed + 15}]})
    assert admitted(open_rule, ns, ENGINE, seed + 3)
    assert not admitted(policy, "elsewhere", AGENT, seed)
