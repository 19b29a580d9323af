"""Node readiness labels: `<namespace>.cache.weightcache.io/<name>=ready` where a cache is Ready.

The admission webhook steers engine pods to these nodes with node affinity, so a label must
exist exactly while the whole group serves: set on every placed node once all ranks are
ready, removed everywhere else (and on deletion). Patches only touch nodes whose label is
wrong, so a steady state costs no API calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightcache.constants import node_ready_label
from weightcache.contracts.vocabulary import READY_VALUE
from weightcache.operator.kube import Kube, path


def label_changes(
    labels_by_node: Mapping[str, Mapping[str, str]],
    key: str,
    ready_nodes: Iterable[str],
) -> dict[str, str | None]:
    """node -> new value (None removes) for every node whose label must change."""
    ready = set(ready_nodes)
    changes: dict[str, str | None] = {}
    for node, labels in labels_by_node.items():
        has = labels.get(key) == READY_VALUE
        if node in ready and not has:
            changes[node] = READY_VALUE
        elif node not in ready and key in labels:
            changes[node] = None
    return changes


async def sync_labels(
    kube: Kube,
    namespace: str,
    name: str,
    labels_by_node: Mapping[str, Mapping[str, str]],
    ready_nodes: Iterable[str],
) -> dict[str, str | None]:
    """Apply the label changes; returns what was changed (nodes that vanished are skipped)."""
    key = node_ready_label(namespace, name)
    changes = label_changes(labels_by_node, key, ready_nodes)
    for node, value in changes.items():
        await kube.patch(path("v1", "nodes", name=node), {"metadata": {"labels": {key: value}}})
    return changes
