"""Fixtures of the chart tests: renders are cached per value set (helm takes ~0.1 s each)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.chart import chart

# name -> (values files, API versions the pretend cluster serves)
VALUE_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "prometheus-operator": ((), (chart.PROMETHEUS_API,)),
    "cert-manager": (("cert-manager.yaml",), (chart.PROMETHEUS_API, chart.CERT_MANAGER_API)),
    "minimal": (("minimal.yaml",), (chart.PROMETHEUS_API,)),
    "production": (("production.yaml",), (chart.CERT_MANAGER_API,)),
    "examples": (("../../../charts/weightcache/examples/values-caches.yaml",), ()),
}


@functools.cache
def rendered(name: str, kube_version: str = chart.KUBE_VERSIONS[-1]) -> tuple[dict[str, Any], ...]:
    files, apis = VALUE_SETS[name]
    return tuple(
        chart.render(
            values=[chart.VALUES / f for f in files], api_versions=apis, kube_version=kube_version
        )
    )


@pytest.fixture(scope="session")
def default_docs() -> tuple[dict[str, Any], ...]:
    return rendered("default")
