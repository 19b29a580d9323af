"""Node labels `<namespace>.cache.weightcache.io/<name>`: `ready` where a cache is Ready,
`loading` where its agent pod runs while it loads.

The admission webhook steers engine pods to these nodes with node affinity (required: one of
the two values; preferred: `ready`). `ready` exists exactly while the whole group serves: set on
every placed node once all ranks are ready. Before that, a placed node whose current agent pod
runs is `loading`: an engine scheduled there starts its interpreter, imports and CUDA context
while the daemon loads and attaches when its rank binds (the client waits for a loading daemon,
`weightcache.native.engine.loading`), instead of waiting for READY and only then starting.
Every other node loses the label (and every node on deletion). Patches only touch nodes whose
label is wrong, so a steady state costs no API calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightcache.constants import node_ready_label
from weightcache.contracts.vocabulary import LOADING_VALUE, READY_VALUE
from weightcache.operator.kube import Kube, path


def label_changes(
    labels_by_node: Mapping[str, Mapping[str, str]],
    key: str,
    ready_nodes: Iterable[str],
    loading_nodes: Iterable[str] = (),
) -> dict[str, str | None]:
    """node -> new value (None removes) for every node whose label must change; a node in
    both sets is ready."""
    ready = set(ready_nodes)
    loading = set(loading_nodes) - ready
    changes: dict[str, str | None] = {}
    for node, labels in labels_by_node.items():
        want = READY_VALUE if node in ready else LOADING_VALUE if node in loading else None
        if want is None:
            if key in labels:
                changes[node] = None
        elif labels.get(key) != want:
            changes[node] = want
    return changes


async def sync_labels(
    kube: Kube,
    namespace: str,
    name: str,
    labels_by_node: Mapping[str, Mapping[str, str]],
    ready_nodes: Iterable[str],
    loading_nodes: Iterable[str] = (),
) -> dict[str, str | None]:
    """Apply the label changes; returns what was changed (nodes that vanished are skipped)."""
    key = node_ready_label(namespace, name)
    changes = label_changes(labels_by_node, key, ready_nodes, loading_nodes)
    for node, value in changes.items():
        await kube.patch(path("v1", "nodes", name=node), {"metadata": {"labels": {key: value}}})
    return changes
