"""Glue for running the real operator against kmock's Kubernetes emulator.

Tests and benchmarks run `weightcache operator` (or its kopf handlers) against kmock. kmock
serves only the resources declared to it: creating the CRD object does not make the API
discoverable, so the WeightCache resource is declared here once, with kmock's bundled
built-in resources. The kubeconfig points kopf at the emulator; kopf reads it at login time.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from weightcache import constants as C


def declare_api(k8s: Any) -> None:
    """Make the emulator serve core resources and the WeightCache API."""
    import kmock

    k8s.resources.load_bundled()
    k8s.resources[f"{C.GROUP}/{C.VERSION}/{C.PLURAL}"] = kmock.ResourceInfo(
        kind=C.KIND,
        singular=C.SINGULAR,
        namespaced=True,
        shortnames={C.SHORT_NAME},
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )


def kubeconfig(server: str, *, token: str = "test", namespace: str | None = None) -> str:
    """A kubeconfig (YAML flow style) with one context for the emulator at `server`."""
    ns = f", namespace: {namespace}" if namespace else ""
    return (
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{server}'}}}}]\n"
        f"users: [{{name: kmock, user: {{token: {token}}}}}]\n"
        f"contexts: [{{name: kmock, context: {{cluster: kmock, user: kmock{ns}}}}}]\n"
    )


def write_kubeconfig(path: str | Path, server: str, **kw: Any) -> Path:
    path = Path(path)
    path.write_text(kubeconfig(server, **kw))
    return path


def cache_object(name: str, namespace: str, spec: dict[str, Any], generation: int = 1) -> dict:
    """A WeightCache as the API server would hold it, ready to POST to kmock."""
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            # kopf tests resourceVersion in its JSON patches; kmock never changes it.
            "resourceVersion": "1",
            "generation": generation,
        },
        "spec": spec,
    }
