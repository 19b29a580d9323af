"""The placement planner: which nodes hold a cache, in which rank order, and what each GPU serves.

Pure functions over plain data, so the rules are unit-tested without an API server:
- a node is eligible when it is Ready, schedulable, matches the selector and required node
  affinity, has every NoSchedule/NoExecute taint tolerated and has enough GPUs;
- ranks are sticky: a placed node keeps its rank while it stays eligible, so nodes coming and
  going elsewhere never reshuffle a group; a lost node's rank goes to the first eligible
  spare (by name), and the caller restarts the whole group with a new epoch;
- what each GPU serves is not decided here: the plan carries the layout, and every reader
  derives the ranks with the one formula of weightcache.contracts.layout (vLLM's global rank
  `r * per_node + i`, TP rank `g % tp`, DP rank `g // tp`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec

GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
GPU_COUNT_LABELS = ("nvidia.com/gpu.count", "amd.com/gpu.count")
# Tolerations the DaemonSet controller adds to every DaemonSet pod, as (key, effect)
# (kubernetes/kubernetes pkg/controller/daemon/util/daemonset_util.go,
# AddOrUpdateDaemonPodTolerations): not-ready and unreachable for NoExecute only (a
# `node.kubernetes.io/not-ready:NoSchedule` taint still blocks), the node-condition taints
# for NoSchedule, and network-unavailable only for hostNetwork pods, which agents are not.
# Readiness and cordoning are also judged from the node's own fields.
DAEMONSET_TOLERATED = frozenset(
    {
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    }
)


@dataclass(frozen=True)
class NodeInfo:
    """What placement needs to know of a node (summarised from the Node object)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    gpus: int = 0
    ready: bool = True
    unschedulable: bool = False

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> NodeInfo:
        meta, spec, status = node.get("metadata", {}), node.get("spec", {}), node.get("status", {})
        labels = dict(meta.get("labels") or {})
        return cls(
            name=meta["name"],
            labels=labels,
            taints=tuple(spec.get("taints") or ()),
            gpus=_gpu_count(status, labels),
            ready=any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ()
            ),
            unschedulable=bool(spec.get("unschedulable")),
        )

    def summary(self) -> tuple:
        """A hashable digest: placement only reacts when this changes (not on heartbeats)."""
        taints = tuple(
            sorted((t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in self.taints)
        )
        return (
            tuple(sorted(self.labels.items())),
            taints,
            self.gpus,
            self.ready,
            self.unschedulable,
        )


def _gpu_count(status: Mapping[str, Any], labels: Mapping[str, str]) -> int:
    for source in (status.get("allocatable") or {}, status.get("capacity") or {}):
        for resource in GPU_RESOURCES:
            if resource in source:
                try:
                    return int(str(source[resource]))
                except ValueError:
                    continue
    for label in GPU_COUNT_LABELS:
        if labels.get(label, "").isdigit():
            return int(labels[label])
    return 0


def ineligible_reason(node: NodeInfo, spec: WeightCacheSpec) -> str | None:
    """Why `node` cannot host the cache (a short reason key), or None when it can."""
    if not node.ready:
        return "NotReady"
    placement = spec.placement
    selector = placement.node_selector or {}
    if any(node.labels.get(key) != value for key, value in selector.items()):
        return "NodeSelectorMismatch"
    if not _affinity_matches(node, placement.affinity or {}):
        return "AffinityMismatch"
    if not _taints_tolerated(node.taints, placement.tolerations or []):
        return "TaintNotTolerated"
    if spec.needs_gpus and node.gpus < spec.gpus:
        return "NotEnoughGPUs"
    return None


def _taints_tolerated(taints: Iterable[Mapping[str, Any]], tolerations: list[dict]) -> bool:
    for taint in taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if (taint.get("key"), taint.get("effect")) in DAEMONSET_TOLERATED:
            continue
        if not any(_tolerates(tol, taint) for tol in tolerations):
            return False
    return True


def _tolerates(tol: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if tol.get("effect") and tol["effect"] != taint.get("effect"):
        return False
    if tol.get("operator") == "Exists":
        return not tol.get("key") or tol["key"] == taint.get("key")
    return tol.get("key") == taint.get("key") and (tol.get("value") or "") == (
        taint.get("value") or ""
    )


def _affinity_matches(node: NodeInfo, affinity: Mapping[str, Any]) -> bool:
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(_term_matches(node, term) for term in terms)


def _term_matches(node: NodeInfo, term: Mapping[str, Any]) -> bool:
    for expr in term.get("matchExpressions") or []:
        if not _expression_matches(node.labels.get(expr.get("key", "")), expr):
            return False
    for expr in term.get("matchFields") or []:
        value = node.name if expr.get("key") == "metadata.name" else None
        if not _expression_matches(value, expr):
            return False
    return True


def _expression_matches(value: str | None, expr: Mapping[str, Any]) -> bool:
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            left, right = int(value), int(values[0])
        except ValueError:
            return False
        return left > right if op == "Gt" else left < right
    return False


@dataclass(frozen=True)
class PlacementResult:
    """The outcome of one planning round."""

    nodes: tuple[str, ...]  # index = node rank; empty when unschedulable
    eligible: int
    replaced: tuple[str, ...] = ()  # previously placed nodes that lost their rank
    reasons: Mapping[str, int] = field(default_factory=dict)  # ineligible nodes by reason

    @property
    def schedulable(self) -> bool:
        return bool(self.nodes)


def place(
    previous: list[str],
    nodes: Iterable[NodeInfo],
    spec: WeightCacheSpec,
) -> PlacementResult:
    """Choose `parallelism.nodes` nodes, keeping every previous node still eligible at its rank.

    `previous` lists the node names by rank from the last plan (empty for a new cache).
    """
    by_name = {node.name: node for node in nodes}
    reasons: Counter[str] = Counter()
    eligible: set[str] = set()
    for node in by_name.values():
        reason = ineligible_reason(node, spec)
        if reason is None:
            eligible.add(node.name)
        else:
            reasons[reason] += 1
    want = spec.parallelism.nodes
    if len(eligible) < want:
        return PlacementResult(nodes=(), eligible=len(eligible), reasons=dict(reasons))
    # A previous plan for another group size is not a base to keep ranks from.
    keep = list(previous) if len(previous) == want else []
    chosen: list[str | None] = [name if name in eligible else None for name in keep]
    replaced = tuple(name for name in keep if name not in eligible)
    if not keep:
        chosen = [None] * want
    spares = iter(sorted(eligible - set(chosen)))
    final = [name if name is not None else next(spares) for name in chosen]
    return PlacementResult(
        nodes=tuple(final), eligible=len(eligible), replaced=replaced, reasons=dict(reasons)
    )

