"""Warning events on engine pods whose ranks missed their GPUs' shards.

Engines report every start's GPU alignment to the node agent (weightcache.contracts.
alignment); the agent exports the counters and keeps its latest misses in gRPC Status
(`alignment_misses`), because agents have no Kubernetes API access. The operator already asks
ready agents for Status on every reconcile, so it turns misses it has not seen yet into a
`Warning` event `GPUAlignmentMissed` on the engine Pod (`kubectl describe pod` shows which
ranks load from disk and on which GPUs). Each agent numbers its misses; `seen` remembers the
highest number per agent address, and a lower one means the agent restarted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from weightcache.operator import events

REASON = "GPUAlignmentMissed"


def unseen(seen: MutableMapping[str, int], address: str, misses: Iterable[Any]) -> list[Any]:
    """The misses of agent `address` not yet turned into events; updates `seen`."""
    misses = sorted(misses, key=lambda m: m.seq)
    if not misses:
        return []
    last = seen.get(address, 0)
    if misses[-1].seq < last:  # the agent restarted and counts from 1 again
        last = 0
    seen[address] = misses[-1].seq
    return [m for m in misses if m.seq > last]


def pod_event(namespace: str, cache: str, miss: Any, component: str) -> dict[str, Any]:
    ref = {"apiVersion": "v1", "kind": "Pod", "name": miss.pod, "namespace": namespace}
    message = (f"WeightCache {cache}: GPU alignment {miss.result}, {miss.missed_ranks} rank(s) "
               f"load from disk: {miss.detail}")
    return events.event_body(ref, type_="Warning", reason=REASON, message=message,
                             component=component)


def events_for(
    seen: MutableMapping[str, int], meta: Mapping[str, Any],
    by_address: Mapping[str, Iterable[Any]], component: str,
) -> list[dict[str, Any]]:
    out = []
    for address, misses in by_address.items():
        for miss in unseen(seen, address, misses):
            out.append(pod_event(meta["namespace"], meta["name"], miss, component))
    return out
