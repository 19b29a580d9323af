"""The placement plan: what the operator writes into `<cache>-placement` (key `plan.json`)
and every agent of the group reads from its mounted file.

One typed document for both sides, so a field cannot be written by one and forgotten by the
other: the operator builds a `Plan` and stores `plan.to_json()`; the agent calls
`Plan.from_json()` and gets either a fully validated plan or a `PlanError` naming the first bad
field (one line, meant for a person reading pod logs). Everything derivable is derived here
rather than stored: which global, TP and DP rank each device of a node serves comes from
`ranks.node_ranks` (the one rank formula), never from a per-node table in the document.

Unknown keys are ignored on read, so an agent keeps reading a plan from a newer operator that
adds a field; the JSON is written with sorted keys and no spaces, so its hash (the DaemonSet's
`plan-hash` annotation) only changes when the content does.

Version 2 (`"version": 2`) stopped carrying a second copy of the layout: `spec.parallelism`
and `spec.gpusPerNode` are left out of `spec`, and `layout`, `nodeCount` and `gpusPerNode` are
the only statement of it. Version 1 documents (no `version` key) are read too; their copy is
ignored apart from the pipeline rule. Either way the typed `Plan.spec` states the layout the
daemons are launched with (`spec.layout() == plan.layout`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightcache.api.v1alpha1 import Parallelism, WeightCacheSpec
from weightcache.contracts.layout import Layout, LocalRank, data_start_rank, node_ranks
from weightcache.contracts.vocabulary import RUNTIMES
from weightcache.errors import ProjectError

# A plan.json is a few KiB; anything far larger is not a plan.
MAX_PLAN_BYTES = 1 << 20
PLAN_VERSION = 2
# What version 2 leaves out of `spec`: the layout is stated by `layout` and `gpusPerNode`.
LAYOUT_KEYS = ("parallelism", "gpusPerNode")
SEED_KEY = "seedFrom"


class PlanError(ProjectError, ValueError):
    """A plan document that no agent can act on; the message names the field."""


@dataclass(frozen=True)
class SeedSource:
    """The source cache this group adopts warmup tables from (`spec.warmup.seed.from`), as
    the operator found it Ready: the first seed port of its daemons and, per node rank, the
    address of its agent pod holding that node rank (docs/warmup.md). A node rank without an
    address has no ready peer and tunes by itself."""

    cache: str
    port: int
    hosts: dict[int, str]

    def to_doc(self) -> dict[str, Any]:
        return {"cache": self.cache, "port": self.port,
                "hosts": [{"rank": r, "host": h} for r, h in sorted(self.hosts.items())]}


@dataclass(frozen=True)
class Plan:
    """A parsed `plan.json` (docs/interfaces.md, "Placement ConfigMap")."""

    cache: str
    namespace: str
    uid: str
    epoch: int
    runtime: str
    master_addr: str
    node_count: int
    gpus_per_node: int
    nodes: dict[str, int]  # node name -> node rank, in rank order
    layout: Layout  # the launched layout: filler replicas counted in `data`
    spec: WeightCacheSpec = field(default_factory=WeightCacheSpec)
    # Operator-observed, not part of what restarts the agents (resources.plan_hash).
    seed_from: SeedSource | None = None

    @property
    def ranks_per_node(self) -> int:
        """Daemon ranks on every node of the group (the world split evenly)."""
        return self.layout.world_size // self.node_count

    def local_ranks(self, node_rank: int) -> list[LocalRank]:
        """What each local device of node `node_rank` serves (vLLM's global layout)."""
        return node_ranks(node_rank, self.ranks_per_node, self.layout.tensor)

    def data_start_rank(self, node_rank: int) -> int:
        """vLLM's `--data-parallel-start-rank` of node `node_rank`."""
        return data_start_rank(node_rank, self.ranks_per_node, self.layout.tensor)

    def to_doc(self) -> dict[str, Any]:
        lay = self.layout
        spec = {k: v for k, v in self.spec.to_dict().items() if k not in LAYOUT_KEYS}
        seed = {SEED_KEY: self.seed_from.to_doc()} if self.seed_from is not None else {}
        return {
            **seed,
            "version": PLAN_VERSION,
            "cache": self.cache,
            "namespace": self.namespace,
            "uid": self.uid,
            "epoch": self.epoch,
            "runtime": self.runtime,
            "masterAddr": self.master_addr,
            "nodeCount": self.node_count,
            "gpusPerNode": self.gpus_per_node,
            "nodes": [
                {"node": name, "rank": rank}
                for name, rank in sorted(self.nodes.items(), key=lambda item: item[1])
            ],
            "layout": {
                "tensor": lay.tensor,
                "data": lay.data,
                "dataLocal": lay.data_local,
                "expert": lay.expert,
                "worldSize": lay.world_size,
            },
            "spec": spec,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Parse and validate a plan document; raise `PlanError` naming the first bad field."""
        if len(text) > MAX_PLAN_BYTES:
            raise PlanError(
                f"plan: {len(text)} bytes is larger than the {MAX_PLAN_BYTES} byte limit"
            )
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan: not valid JSON ({exc})") from exc
        return cls.from_doc(doc)

    @classmethod
    def from_doc(cls, doc: Any) -> Plan:
        if not isinstance(doc, dict):
            raise PlanError("plan: top level must be a JSON object")
        runtime = _str(doc, "runtime")
        if runtime not in RUNTIMES:
            raise PlanError(
                f"plan: runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}"
            )
        node_count = _int(doc, "nodeCount", "", minimum=1)
        nodes = _nodes(doc.get("nodes"), node_count)
        layout = _layout(doc.get("layout"), node_count)
        per_node = layout.world_size // node_count
        gpus = _int(doc, "gpusPerNode", "", minimum=1, default=per_node)
        if gpus < per_node:
            raise PlanError(
                f"plan: gpusPerNode {gpus} is fewer than the {per_node} ranks each node serves"
            )
        version = _int(doc, "version", "", minimum=1, default=1)
        if version > PLAN_VERSION:
            raise PlanError(
                f"plan: version {version} is newer than this agent reads ({PLAN_VERSION})"
            )
        raw = doc.get("spec")
        if not isinstance(raw, dict):
            raise PlanError("plan: spec must be an object (the WeightCache spec)")
        cache, namespace = _str(doc, "cache"), _str(doc, "namespace")
        return cls(
            cache=cache,
            namespace=namespace,
            uid=str(doc.get("uid", "")),
            epoch=_int(doc, "epoch", "", default=0),
            runtime=runtime,
            master_addr=str(doc.get("masterAddr") or ""),
            node_count=node_count,
            gpus_per_node=gpus,
            nodes=nodes,
            layout=layout,
            spec=_spec(raw, namespace, cache, layout, gpus),
            seed_from=_seed_from(doc.get(SEED_KEY), node_count),
        )


def _int(
    obj: Mapping[str, Any], key: str, where: str, *, minimum: int = 0, default: Any = None
) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"plan: {where}{key} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"plan: {where}{key} must be >= {minimum}, got {value}")
    return value


def _str(obj: Mapping[str, Any], key: str, where: str = "") -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise PlanError(f"plan: {where}{key} must be a non-empty string, got {value!r}")
    return value


def _nodes(raw: Any, node_count: int) -> dict[str, int]:
    if not isinstance(raw, list) or not raw:
        raise PlanError("plan: nodes must be a non-empty list of {node, rank}")
    nodes: dict[str, int] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise PlanError(f"plan: nodes[{i}] must be an object")
        name = _str(item, "node", f"nodes[{i}].")
        rank = _int(item, "rank", f"nodes[{i}].")
        if name in nodes:
            raise PlanError(f"plan: node {name!r} appears twice")
        nodes[name] = rank
    if sorted(nodes.values()) != list(range(node_count)):
        raise PlanError(
            f"plan: node ranks {sorted(nodes.values())} must be exactly 0..{node_count - 1}"
        )
    return dict(sorted(nodes.items(), key=lambda item: item[1]))


def _layout(lay: Any, node_count: int) -> Layout:
    if not isinstance(lay, dict):
        raise PlanError("plan: layout must be an object")
    tensor = _int(lay, "tensor", "layout.", minimum=1)
    data = _int(lay, "data", "layout.", minimum=1, default=1)
    world_size = _int(lay, "worldSize", "layout.", minimum=1, default=tensor * data)
    if world_size != tensor * data:
        raise PlanError(f"plan: layout.worldSize {world_size} != tensor {tensor} x data {data}")
    if world_size % node_count:
        raise PlanError(
            f"plan: world size {world_size} does not split evenly over {node_count} nodes"
        )
    return Layout(
        tensor=tensor,
        data=data,
        nodes=node_count,
        data_local=_int(lay, "dataLocal", "layout.", minimum=1, default=max(data // node_count, 1)),
        expert=bool(lay.get("expert", False)),
    )


def _seed_from(raw: Any, node_count: int) -> SeedSource | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise PlanError(f"plan: {SEED_KEY} must be an object")
    where = f"{SEED_KEY}."
    port = _int(raw, "port", where, minimum=1)
    if port > 65535:
        raise PlanError(f"plan: {where}port must be a port 1-65535, got {port}")
    hosts: dict[int, str] = {}
    items = raw.get("hosts")
    if not isinstance(items, list):
        raise PlanError(f"plan: {where}hosts must be a list of {{rank, host}}")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PlanError(f"plan: {where}hosts[{i}] must be an object")
        rank = _int(item, "rank", f"{where}hosts[{i}].")
        if rank >= node_count:
            raise PlanError(f"plan: {where}hosts[{i}].rank {rank} is not a node rank")
        hosts[rank] = _str(item, "host", f"{where}hosts[{i}].")
    return SeedSource(cache=_str(raw, "cache", where), port=port, hosts=hosts)


def _spec(
    raw: Mapping[str, Any], namespace: str, cache: str, layout: Layout, gpus: int
) -> WeightCacheSpec:
    """The typed spec, its layout taken from the plan's (a version 1 copy only checked)."""
    old = raw.get("parallelism")
    if old is not None:
        if not isinstance(old, dict):
            raise PlanError("plan: spec.parallelism must be an object")
        problem = Parallelism.from_raw(old).pipeline_problem()
        if problem:
            raise PlanError(f"plan: {problem}")
    body = {k: v for k, v in raw.items() if k not in LAYOUT_KEYS}
    return WeightCacheSpec.from_spec(body, namespace, cache).with_layout(layout, gpus)
