"""The whole system on kind: install, cache Ready, engines attach from the cache across
restarts and agent failures, and uninstall leaves nothing behind. Tests run in order and
share the cluster (pytest runs a module's tests in file order)."""

from __future__ import annotations

import re

from e2e.conftest import MANIFESTS, NS, RELEASE, RELEASE_NS, ROOT, Kube

CACHE = "tiny"
ENGINE = "engine"


def phase(kube: Kube) -> str | None:
    obj = kube.get("weightcache", CACHE, "-n", NS)
    return ((obj or {}).get("status") or {}).get("phase")


def engine_line(kube: Kube, pod: str = ENGINE) -> str | None:
    match = re.search(r"^source=.*$", kube.logs(pod), re.MULTILINE)
    return match.group(0) if match else None


def start_engine(kube: Kube) -> str:
    kube.kubectl("apply", "-f", str(MANIFESTS / "engine.yaml"))
    kube.kubectl("wait", "-n", NS, f"pod/{ENGINE}", "--for=condition=Ready", "--timeout=180s")
    return kube.wait_for("the engine's load report", lambda: engine_line(kube), timeout=120)


def test_helm_install(kube: Kube):
    kube.helm(
        "install",
        RELEASE,
        str(ROOT / "charts" / "weightcache"),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "-f",
        str(ROOT / "e2e" / "values.yaml"),
        "--wait",
        "--timeout",
        "5m",
    )
    kube.kubectl(
        "rollout", "status", "-n", RELEASE_NS, "deployment/weightcache-operator", "--timeout=180s"
    )
    deploy = kube.get("deployment", "weightcache-operator", "-n", RELEASE_NS)
    assert deploy["status"]["readyReplicas"] == 2
    assert kube.get("crd", "weightcaches.weightcache.io") is not None


def test_cache_becomes_ready(kube: Kube):
    kube.kubectl("apply", "-f", str(MANIFESTS / "namespace.yaml"))
    kube.kubectl("apply", "-f", str(MANIFESTS / "cache.yaml"))
    kube.wait_for("WeightCache Ready", lambda: phase(kube) == "Ready", timeout=600)
    status = kube.get("weightcache", CACHE, "-n", NS)["status"]
    assert status["ranksReady"] == status["ranksTotal"] == 1
    assert status["bytesCached"] > 0
    nodes = kube.items("nodes", "-l", f"{NS}.cache.weightcache.io/{CACHE}=ready")
    assert len(nodes) == 1


def test_engine_attaches_from_the_cache(kube: Kube):
    line = start_engine(kube)
    assert line.startswith("source=cache"), line
    pod = kube.get("pod", ENGINE, "-n", NS)
    assert pod["metadata"]["labels"]["weightcache.io/injected"] == CACHE
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
    assert env["WEIGHTCACHE_SOCKET_DIR"] == f"/var/run/weightcache/{NS}/{CACHE}"


def test_engine_restart_attaches_again(kube: Kube):
    kube.kubectl("delete", "pod", "-n", NS, ENGINE, "--wait=true")
    line = start_engine(kube)
    assert line.startswith("source=cache"), line


def test_agent_pod_killed_engine_keeps_serving_and_cache_recovers(kube: Kube):
    (agent,) = kube.items("pods", "-n", NS, "-l", "app.kubernetes.io/name=weightcache-agent")
    before = kube.logs(ENGINE).count("serving checksum=")
    kube.kubectl(
        "delete", "pod", "-n", NS, agent["metadata"]["name"], "--grace-period=0", "--force"
    )
    # The engine holds its mapping: it keeps serving with the same weights.
    kube.wait_for(
        "the engine to keep serving",
        lambda: kube.logs(ENGINE).count("serving checksum=") > before + 1,
        timeout=60,
    )
    assert kube.get("pod", ENGINE, "-n", NS)["status"]["phase"] == "Running"
    checksums = set(re.findall(r"checksum=(\S+)", kube.logs(ENGINE)))
    assert len(checksums) == 1, checksums
    # The DaemonSet replaces the agent and the cache is Ready again.
    kube.wait_for("WeightCache Ready again", lambda: phase(kube) == "Ready", timeout=600)
    kube.kubectl("delete", "pod", "-n", NS, ENGINE, "--wait=true")
    assert start_engine(kube).startswith("source=cache")


def test_helm_uninstall_leaves_nothing(kube: Kube):
    kube.kubectl("delete", "pod", "-n", NS, ENGINE, "--wait=true")
    kube.kubectl("delete", "weightcache", CACHE, "-n", NS, "--wait=true", "--timeout=180s")
    kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "5m")
    left = []
    for kind in (
        "all",
        "configmaps",
        "secrets",
        "serviceaccounts",
        "roles",
        "rolebindings",
        "networkpolicies",
        "poddisruptionbudgets",
    ):
        for ns in (RELEASE_NS, NS):
            for item in kube.items(kind, "-n", ns, "-l", "app.kubernetes.io/part-of=weightcache"):
                left.append(f"{ns}/{item['kind']}/{item['metadata']['name']}")
            for item in kube.items(
                kind, "-n", ns, "-l", "app.kubernetes.io/name=weightcache-agent"
            ):
                left.append(f"{ns}/{item['kind']}/{item['metadata']['name']}")
    for kind in (
        "clusterroles",
        "clusterrolebindings",
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
        "clusterkopfpeerings",
    ):
        for item in kube.items(kind):
            if "weightcache" in item["metadata"]["name"]:
                left.append(f"{item['kind']}/{item['metadata']['name']}")
    for node in kube.items("nodes"):
        for key in node["metadata"].get("labels", {}):
            if ".cache.weightcache.io/" in key:
                left.append(f"node {node['metadata']['name']} label {key}")
    # Everything the operator wrote into the release namespace went with it as well.
    for secret in kube.items("secrets", "-n", RELEASE_NS):
        if secret["metadata"]["name"].startswith("weightcache"):
            left.append(f"Secret/{secret['metadata']['name']}")
    assert left == []
