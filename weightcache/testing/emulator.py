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


def _matches_requirement(req: dict[str, Any], value: str | None) -> bool:
    """One node selector requirement against a node's value (a label, or a field)."""
    op, values = req.get("operator"), list(req.get("values") or [])
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            left, right = int(value), int(values[0])
        except ValueError:
            return False
        return left > right if op == "Gt" else left < right
    return False


def _matches_term(term: dict[str, Any], node: dict[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    fields = {"metadata.name": (node.get("metadata") or {}).get("name")}
    exprs = term.get("matchExpressions") or []
    field_reqs = term.get("matchFields") or []
    if not exprs and not field_reqs:
        return False  # an empty term matches no node
    return all(_matches_requirement(r, labels.get(r.get("key"))) for r in exprs) and all(
        _matches_requirement(r, fields.get(r.get("key"))) for r in field_reqs
    )


def schedulable_nodes(pod_spec: dict[str, Any], nodes: list[dict[str, Any]]) -> list[str]:
    """The nodes a DaemonSet controller would run this pod template on, in the given order.

    The scheduler's rule for required node affinity, as Kubernetes documents it ("Assign Pods
    to Nodes", node affinity): the `nodeSelectorTerms` are ORed, the requirements inside one
    term are ANDed, an empty term matches nothing; `nodeSelector` must match as well. Written
    here from that rule, not from the operator's own `pinned_nodes`, so a test of the operator
    cannot pass by agreeing with itself (the operator writes one `matchFields` term per node,
    since a real API server takes a single value per `metadata.name` requirement).
    """
    selector = pod_spec.get("nodeSelector") or {}
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms")
    out = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        if terms is not None and not any(_matches_term(t, node) for t in terms):
            continue
        out.append(node["metadata"]["name"])
    return out
