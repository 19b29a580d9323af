"""The chart lints, renders for every value set, and every object is valid for its API."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import yaml

from tests.chart import chart
from tests.chart.conftest import VALUE_SETS, rendered


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(name):
    files, _ = VALUE_SETS[name]
    args = ["lint", "--strict", str(chart.CHART)]
    for item in files:
        args += ["--values", str(chart.VALUES / item)]
    out = chart.helm(*args)
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_validates(name):
    docs = rendered(name)
    assert docs
    seen = collections.Counter(chart.validate(doc) for doc in docs)
    assert seen["kubernetes"] > 0
    keys = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "two objects share kind/namespace/name"


@pytest.mark.parametrize("kube_version", chart.KUBE_VERSIONS)
def test_default_render_validates_on_supported_kubernetes_versions(kube_version):
    for doc in rendered("default", kube_version):
        chart.validate(doc, kube_version)


def test_kube_version_below_minimum_is_refused():
    proc = chart.helm("template", "x", str(chart.CHART), "--kube-version", "1.29.0", check=False)
    assert proc.returncode != 0
    assert "kubeVersion" in proc.stderr or "incompatible" in proc.stderr


def test_chart_crds_match_generated_crds():
    generated = sorted((chart.ROOT / "crds").glob("*.yaml"))
    assert generated, "crds/ is empty: run `make crds`"
    for path in generated:
        copy = chart.CHART / "crds" / path.name
        assert copy.exists() and copy.read_text() == path.read_text(), (
            f"charts/weightcache/crds/{path.name} differs from crds/: run `make crds`"
        )


def test_crds_are_valid_and_include_kopf_peering():
    crds = chart.crd_documents()
    assert ("weightcache.io/v1alpha1", "WeightCache") in crds
    assert ("kopf.dev/v1", "ClusterKopfPeering") in crds
    assert ("kopf.dev/v1", "KopfPeering") in crds
    for doc in crds.values():
        chart.validate(doc)


def test_crd_upgrade_hook_applies_every_chart_crd(default_docs):
    hook_cm = chart.one(default_docs, "ConfigMap", "-crd-upgrade")
    files = {p.name: p.read_text() for p in (chart.CHART / "crds").glob("*.yaml")}
    assert {k: v.rstrip("\n") for k, v in hook_cm["data"].items()} == {
        k: v.rstrip("\n") for k, v in files.items()
    }
    role = chart.one(default_docs, "ClusterRole", "-crd-upgrade")
    names = {doc["metadata"]["name"] for doc in chart.crd_documents().values()}
    assert role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": sorted(names),
            "verbs": ["get", "patch"],
        }
    ]
    job = chart.one(default_docs, "Job", "-crd-upgrade")
    for doc in (hook_cm, role, job):
        assert doc["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    # The RBAC and data exist before the Job runs.
    assert int(hook_cm["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["apply", "--server-side"]


def test_monitoring_objects_only_with_the_prometheus_operator_api():
    without = {d["kind"] for d in rendered("default")}
    assert not without & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    with_api = {d["kind"] for d in rendered("prometheus-operator")}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= with_api


def test_prometheus_rule_carries_the_tested_rules_file():
    rule = chart.one(rendered("prometheus-operator"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(
        (chart.CHART / "alerts" / "weightcache.rules.yaml").read_text()
    )


def test_dashboard_configmap_has_the_sidecar_label_and_the_dashboard(default_docs):
    cm = chart.one(default_docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (chart.CHART / "dashboards" / "weightcache.json").read_text()
    assert cm["data"]["weightcache.json"].strip() == shipped.strip()


def test_operator_deployment_shape(default_docs):
    dep = chart.one(default_docs, "Deployment", "-operator")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert any(a.startswith("--peering=") for a in container["args"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(ports) == {"metrics", "health", "webhook"}
    peering = chart.one(default_docs, "ClusterKopfPeering")
    assert f"--peering={peering['metadata']['name']}" in container["args"]
    pdb = chart.one(default_docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_services_select_the_operator_pods(default_docs):
    dep = chart.one(default_docs, "Deployment", "-operator")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for svc in chart.by_kind(default_docs, "Service"):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports


def test_minimal_values_drop_every_optional_object():
    kinds = collections.Counter(d["kind"] for d in rendered("minimal"))
    assert kinds == {
        "ServiceAccount": 1,
        "ClusterRole": 1,
        "ClusterRoleBinding": 1,
        "Deployment": 1,
    }
    dep = chart.one(rendered("minimal"), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-webhook" in args and "--standalone" in args


def test_cert_manager_mode(default_docs):
    docs = rendered("cert-manager")
    cert = chart.one(docs, "Certificate")
    assert cert["spec"]["issuerRef"] == {
        "kind": "ClusterIssuer",
        "name": "internal-ca",
        "group": "cert-manager.io",
    }
    assert not chart.by_kind(docs, "Issuer"), "an issuerRef was given: no Issuer of our own"
    svc = chart.one(docs, "Service", "-webhook")["metadata"]["name"]
    assert f"{svc}.weightcache-system.svc" in cert["spec"]["dnsNames"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        ann = chart.one(docs, kind)["metadata"]["annotations"]
        assert (
            ann["cert-manager.io/inject-ca-from"]
            == f"weightcache-system/{cert['metadata']['name']}"
        )
    dep = chart.one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--webhook-cert-mode=cert-manager" in args and "--webhook-unmanaged" in args
    (vol,) = [v for v in pod["volumes"] if v["name"] == "webhook-certs"]
    assert vol["secret"]["secretName"] == cert["spec"]["secretName"]
    assert not chart.by_kind(docs, "Secret"), "cert-manager writes the Secret"
    # The self-issued Issuer appears when no issuerRef is given.
    assert chart.one(rendered("production"), "Issuer")["spec"] == {"selfSigned": {}}


def _x509_key_pair_ok(data: dict) -> bool:
    """Go's tls.X509KeyPair on a Secret's tls.crt/tls.key: PEM certificate and matching key."""
    import base64

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(base64.b64decode(data.get("tls.crt") or ""))
        key = serialization.load_pem_private_key(
            base64.b64decode(data.get("tls.key") or ""), password=None
        )
    except ValueError:
        return False
    return cert.public_key().public_numbers() == key.public_key().public_numbers()


def test_self_managed_secret_is_rendered_empty_for_the_operator_to_fill(default_docs):
    """Item 7: no `tls: failed to find any PEM data in certificate input` on install.

    The API server warns on every create/update of a kubernetes.io/tls Secret whose tls.crt and
    tls.key are not a key pair (pkg/registry/core/secret/strategy.go, warningsForSecret calls
    tls.X509KeyPair); kubectl and helm print the warning. An empty placeholder must be Opaque.
    """
    secret = chart.one(default_docs, "Secret")
    assert secret["data"] == {"tls.crt": "", "tls.key": ""}
    assert secret["type"] == "Opaque"
    for doc in chart.by_kind(default_docs, "Secret"):
        if doc.get("type") == "kubernetes.io/tls":
            assert _x509_key_pair_ok(doc.get("data") or {}), doc["metadata"]["name"]
    dep = chart.one(default_docs, "Deployment")
    assert (
        f"--webhook-secret={secret['metadata']['name']}"
        in (dep["spec"]["template"]["spec"]["containers"][0]["args"])
    )


def test_production_values(default_docs):
    docs = rendered("production")
    dep = chart.one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    image = pod["containers"][0]["image"]
    assert image.startswith("registry.example.com/ml/weightcache/operator@sha256:")
    args = pod["containers"][0]["args"]
    assert "--namespace=llm-prod" in args and "--namespace=llm-staging" in args
    assert "--all-namespaces" not in args
    assert "--agent-image=registry.example.com/ml/weightcache/agent:0.1.0-cuda" in args
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    policies = chart.by_kind(docs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["llm-prod", "llm-staging"]
    for doc in docs:
        assert doc["metadata"]["labels"]["team"] == "inference"
    assert chart.one(docs, "ConfigMap", "-dashboard")["metadata"]["namespace"] == "monitoring"
    hooks = chart.by_kind(docs, "Job")
    assert hooks and all(
        h["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}] for h in hooks
    )


def test_example_caches_render_as_valid_weightcaches():
    docs = chart.by_kind(rendered("examples"), "WeightCache")
    assert [(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs] == [
        ("default", "tiny"),
        ("inference", "llama-8b"),
    ]


@pytest.mark.parametrize(
    "path", sorted((chart.CHART / "examples").glob("*.yaml")), ids=lambda p: Path(p).name
)
def test_examples_pass_schema_and_operator_validation(path):
    from weightcache.api.v1alpha1 import with_defaults
    from weightcache.operator import spec as cache_spec

    doc = yaml.safe_load(path.read_text())
    if "caches" in doc:
        items = [
            {
                "apiVersion": "weightcache.io/v1alpha1",
                "kind": "WeightCache",
                "metadata": {"name": c["name"], "namespace": c.get("namespace", "default")},
                "spec": c["spec"],
            }
            for c in doc["caches"]
        ]
    else:
        items = [doc]
    for item in items:
        assert chart.validate(item) == "crd"
        meta = item["metadata"]
        spec = with_defaults(item["spec"], meta["namespace"], meta["name"])
        assert cache_spec.validate(spec) == []


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        ((), "The webhook injects"),
        (("webhook.enabled=false",), "The admission webhook is disabled"),
        (("webhook.certificates.mode=cert-manager",), "Certificates come from cert-manager"),
    ],
)
def test_notes_tell_the_user_what_to_do_next(sets, expect):
    args = ["install", "weightcache", str(chart.CHART), "-n", chart.NAMESPACE, "--dry-run=client"]
    for item in sets:
        args += ["--set", item]
    out = chart.helm(*args).stdout
    notes = out[out.index("NOTES:") :]
    assert expect in notes
    assert "kubectl get wc -A -w" in notes
    assert "weightcache.io/cache:" in notes
    assert "helm uninstall weightcache -n weightcache-system" in notes
