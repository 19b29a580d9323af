"""RBAC grants exactly the reviewed list (golden/rbac.yaml) and nothing broader.

A change of the chart's roles must change the golden file in the same commit, so every
new permission is reviewed. Regenerate with WEIGHTCACHE_UPDATE_GOLDEN=1 after a review.
"""

from __future__ import annotations

import os

import pytest
import yaml

from tests.chart import chart
from tests.chart.conftest import VALUE_SETS, rendered

GOLDEN = chart.ROOT / "tests" / "chart" / "golden" / "rbac.yaml"
ROLE_KINDS = ("ClusterRole", "Role")
BINDING_KINDS = ("ClusterRoleBinding", "RoleBinding")


def _roles(docs) -> dict[str, list[dict]]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["rules"] for d in docs if d["kind"] in ROLE_KINDS
    }


def _golden_view() -> dict[str, dict[str, list[dict]]]:
    return {name: _roles(rendered(name)) for name in ("default", "cert-manager", "minimal")}


def test_rbac_matches_the_reviewed_golden_file():
    current = _golden_view()
    if os.environ.get("WEIGHTCACHE_UPDATE_GOLDEN"):
        GOLDEN.write_text(
            "# Reviewed RBAC of the chart per value set (tests/chart/test_rbac.py).\n"
            + yaml.safe_dump(current, sort_keys=True, width=100)
        )
    assert current == yaml.safe_load(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_wildcards_and_no_escalation(name):
    for role in (d for d in rendered(name) if d["kind"] in ROLE_KINDS):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert "nonResourceURLs" not in rule


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_secrets_are_read_only_by_name_in_the_release_namespace(name):
    """The webhook's serving certificate by name; seed tokens (docs/warmup.md) create only,
    which reads no Secret: cluster-wide only when the operator watches every namespace."""
    files = VALUE_SETS[name][0]
    watched = [ns for f in files for ns in ((yaml.safe_load((chart.VALUES / f).read_text())
                                             or {}).get("operator") or {})
               .get("watchNamespaces") or []]
    for role in (d for d in rendered(name) if d["kind"] in ROLE_KINDS):
        for rule in role["rules"]:
            if "secrets" not in rule["resources"]:
                continue
            if rule["verbs"] == ["create"]:
                assert not rule.get("resourceNames") and rule["resources"] == ["secrets"]
                if watched:
                    assert role["kind"] == "Role" and role["metadata"]["namespace"] in watched
                else:
                    assert role["kind"] == "ClusterRole"
                continue
            assert role["kind"] == "Role", "no cluster-wide Secret access"
            assert role["metadata"]["namespace"] == chart.NAMESPACE
            assert rule.get("resourceNames"), "Secrets only by name"
            assert set(rule["verbs"]) <= {"get", "patch"}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_cluster_scoped_writes_are_limited(name):
    """Cluster-scoped objects the operator may write: node labels and named objects only."""
    for role in (d for d in rendered(name) if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            writes = set(rule["verbs"]) - {"get", "list", "watch"}
            cluster_scoped = {
                "customresourcedefinitions",
                "mutatingwebhookconfigurations",
                "validatingwebhookconfigurations",
                "clusterkopfpeerings",
            } & set(rule["resources"])
            if writes and cluster_scoped:
                assert rule.get("resourceNames"), rule
                assert writes <= {"patch"}, rule


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_bindings_bind_only_the_chart_service_accounts(name):
    docs = rendered(name)
    accounts = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "ServiceAccount"
    }
    roles = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in ROLE_KINDS}
    for binding in (d for d in docs if d["kind"] in BINDING_KINDS):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in roles
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount"
            assert (subject["namespace"], subject["name"]) in accounts


def test_agents_get_no_api_access(default_docs):
    """Agents read the mounted plan: no role names them, and their pods mount no token."""
    from weightcache.operator import resources

    for binding in (d for d in default_docs if d["kind"] in BINDING_KINDS):
        for subject in binding["subjects"]:
            assert "agent" not in subject["name"]
    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    from weightcache.api.v1alpha1 import WeightCacheSpec

    spec = WeightCacheSpec.from_spec(
        {
            "runtime": "native",
            "device": "cpu",
            "model": {"path": "/models/m", "volume": {"hostPath": {"path": "/m"}}},
        },
        "ns",
        "c",
    )
    ds = resources.daemonset(
        cache, spec, resources.plan(cache, spec, ["n1"], 1), ["n1"],
        resources.AgentOptions())
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("method", "path", "params", "expected"),
    [
        ("GET", "/apis/weightcache.io/v1alpha1/weightcaches", {"watch": "true"}, True),
        ("PATCH", "/apis/weightcache.io/v1alpha1/namespaces/a/weightcaches/x/status", {}, True),
        (
            "PATCH",
            "/api/v1/namespaces/weightcache-system/secrets/weightcache-webhook-tls",
            {},
            True,
        ),
        ("GET", "/api/v1/namespaces/weightcache-system/secrets/other", {}, False),
        ("GET", "/api/v1/namespaces/weightcache-system/secrets", {}, False),
        ("PATCH", "/api/v1/namespaces/elsewhere/secrets/weightcache-webhook-tls", {}, False),
        # Seed tokens: any namespace may get one created, none read or listed.
        ("POST", "/api/v1/namespaces/weightcache-system/secrets", {}, True),
        ("POST", "/api/v1/namespaces/ml/secrets", {}, True),
        ("GET", "/api/v1/namespaces/ml/secrets/llama-seed", {}, False),
        ("PATCH", "/api/v1/namespaces/ml/secrets/llama-seed", {}, False),
        ("GET", "/api/v1/secrets", {"watch": "true"}, False),
        ("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", {}, False),
        (
            "PATCH",
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/x",
            {},
            False,
        ),
        ("PATCH", "/apis/kopf.dev/v1/clusterkopfpeerings/weightcache", {}, True),
        ("PATCH", "/apis/kopf.dev/v1/clusterkopfpeerings/someone-else", {}, False),
        ("DELETE", "/api/v1/nodes/n1", {}, False),
        ("PUT", "/apis/apps/v1/namespaces/a/daemonsets/x", {}, False),
        ("POST", "/apis/apps/v1/namespaces/a/daemonsets", {}, True),
        ("GET", "/apis/apps/v1/namespaces/a/daemonsets", {"watch": "1"}, False),
        ("DELETE", "/api/v1/namespaces/a/configmaps", {}, False),
    ],
)
def test_authorizer_on_the_default_roles(method, path, params, expected):
    """The authorizer the live test uses to check the operator's real requests, on cases
    that must and must not pass."""
    from tests.chart import rbac_eval

    roles = [d for d in rendered("default") if d["kind"] in ROLE_KINDS]
    roles = [r for r in roles if r["metadata"]["name"].endswith("-operator")]
    attrs = rbac_eval.attributes(method, path, params)
    assert attrs is not None
    assert rbac_eval.allowed(attrs, roles) is expected
    assert rbac_eval.attributes("GET", "/apis/weightcache.io/v1alpha1", {}) is None


@pytest.mark.parametrize("watch", [[], ["llm-a", "llm-b"]])
def test_seed_tokens_grant_follows_the_watched_namespaces_and_can_be_dropped(watch):
    """Create-only Secret grants: one ClusterRole rule, or one Role per watched namespace; none
    with rbac.seedTokens=false (caches then report Seeding False TokenUnavailable)."""
    sets = [f"operator.watchNamespaces[{i}]={ns}" for i, ns in enumerate(watch)]

    def grants(docs):
        return sorted((d["kind"], d["metadata"].get("namespace", "")) for d in docs
                      if d["kind"] in ROLE_KINDS for rule in d["rules"]
                      if "secrets" in rule["resources"] and rule["verbs"] == ["create"])

    on = chart.render(sets=sets)
    assert grants(on) == ([("Role", ns) for ns in watch] if watch else [("ClusterRole", "")])
    bindings = [d for d in on if d["kind"] == "RoleBinding"
                and d["roleRef"]["name"].endswith("-seed-tokens")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == watch
    for doc in on:
        chart.validate(doc)  # raises on a schema violation
    assert grants(chart.render(sets=[*sets, "rbac.seedTokens=false"])) == []
