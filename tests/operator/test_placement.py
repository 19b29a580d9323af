"""The planned rank layout against vLLM's, and sticky ranks under node churn.

The ranks are read back from the placement plan the operator writes (`Plan.local_ranks`, the
one rank formula of weightcache.contracts.layout), so they are what every agent serves.
"""

from __future__ import annotations

import pytest

from weightcache.api.v1alpha1 import WeightCacheSpec, with_defaults
from weightcache.contracts.plan import Plan
from weightcache.operator import resources
from weightcache.operator.placement import NodeInfo, ineligible_reason, place
from weightcache.operator.resources import plan
from weightcache.operator.spec import validate
from weightcache.testing import apirules


def _spec(**par) -> dict:
    gpus = par.pop("gpusPerNode", None)
    raw = {"runtime": "native", "model": {"path": "/models/m"}, "parallelism": par}
    if par.get("expert"):  # expert layouts across DP ranks are vLLM's
        raw.update(runtime="vllm", image="vllm/vllm-openai:v0.31.0")
    if gpus is not None:
        raw["gpusPerNode"] = gpus
    spec = with_defaults(raw, "ns", "c")
    assert validate(spec) == []
    return spec


def _plan(spec: dict) -> Plan:
    """The plan as an agent reads it from the ConfigMap the operator writes."""
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    written = plan(cache, typed, [f"n{i}" for i in range(lay.nodes)], 1)
    return Plan.from_json(written.to_json())


def _vllm_global(node_rank: int, local: int, per_node: int) -> int:
    # vLLM: the global rank of local GPU i on node r.
    return node_rank * per_node + local


def test_tp16_over_two_nodes():
    spec = _spec(tensor=16, nodes=2)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    assert (lay.ranks_per_node, typed.gpus, lay.replicas_per_node(typed.gpus)) == (8, 8, 1)
    for node_rank in range(2):
        slots = _plan(spec).local_ranks(node_rank)
        assert [s.global_rank for s in slots] == [_vllm_global(node_rank, i, 8) for i in range(8)]
        assert [s.tp_rank for s in slots] == list(range(node_rank * 8, node_rank * 8 + 8))
        assert {s.dp_rank for s in slots} == {0}
    all_ranks = [s.global_rank for r in range(2) for s in _plan(spec).local_ranks(r)]
    assert all_ranks == list(range(16))


def test_tp1_dp16_expert_over_four_nodes_of_four():
    spec = _spec(tensor=1, data=16, expert=True, nodes=4)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    assert (lay.ranks_per_node, lay.data_local, typed.gpus) == (4, 4, 4)
    assert lay.expert and lay.world_size == 16
    for node_rank in range(4):
        start = _plan(spec).data_start_rank(node_rank)
        assert start == 4 * node_rank  # the seed's --data-parallel-start-rank 4r
        slots = _plan(spec).local_ranks(node_rank)
        # vLLM's DP placement: local GPU i serves DP rank start_rank + i // tp, TP rank i % tp.
        assert [s.dp_rank for s in slots] == [start + i // 1 for i in range(4)]
        assert [s.tp_rank for s in slots] == [0, 0, 0, 0]
        assert [s.global_rank for s in slots] == [_vllm_global(node_rank, i, 4) for i in range(4)]


def test_tp8_dp2_over_four_nodes():
    spec = _spec(tensor=8, data=2, nodes=4)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    assert (lay.ranks_per_node, typed.gpus) == (4, 4)
    table = {r: _plan(spec).local_ranks(r) for r in range(4)}
    # Each TP group of 8 spans two nodes; DP rank 0 lives on nodes 0-1, DP rank 1 on 2-3.
    assert [s.dp_rank for s in table[0] + table[1]] == [0] * 8
    assert [s.dp_rank for s in table[2] + table[3]] == [1] * 8
    assert [s.tp_rank for s in table[1]] == [4, 5, 6, 7]
    assert [s.tp_rank for s in table[3]] == [4, 5, 6, 7]
    for r, slots in table.items():
        assert [s.global_rank for s in slots] == [_vllm_global(r, i, 4) for i in range(4)]
        # global rank = dp * tp_size + tp_rank, as in vLLM's world group.
        assert all(s.global_rank == s.dp_rank * 8 + s.tp_rank for s in slots)


def test_tp4_dp2_single_node_matches_dp_placement():
    spec = _spec(tensor=2, data=4, nodes=2)
    for node_rank in range(2):
        start = _plan(spec).data_start_rank(node_rank)
        slots = _plan(spec).local_ranks(node_rank)
        assert [s.dp_rank for s in slots] == [start + i // 2 for i in range(4)]
        assert [s.tp_rank for s in slots] == [i % 2 for i in range(4)]


def test_dense_tp_smaller_than_node_fills_it_with_replicas():
    spec = _spec(tensor=2, gpusPerNode=8)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    assert lay.replicas_per_node(typed.gpus) == 4
    slots = _plan(spec).local_ranks(0)
    # Every replica is a complete TP2 group, so an engine given any GPU pair finds its shard.
    assert [s.tp_rank for s in slots] == [0, 1] * 4
    # Replicas are placed as vLLM places data parallelism: DP rank i // tp.
    assert [s.dp_rank for s in slots] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.global_rank for s in slots] == list(range(8))


@pytest.mark.parametrize(
    ("par", "field"),
    [
        ({"tensor": 3, "nodes": 2}, "spec.parallelism.nodes"),
        ({"tensor": 8, "gpusPerNode": 4}, "spec.gpusPerNode"),
        ({"tensor": 1, "data": 8, "expert": True, "gpusPerNode": 16}, "spec.gpusPerNode"),
        ({"tensor": 4, "pipeline": 2}, "spec.parallelism.pipeline"),
        ({"tensor": 2, "gpusPerNode": 7}, "spec.gpusPerNode"),
        ({"tensor": 4, "data": 3, "nodes": 4}, "spec.parallelism.tensor"),
    ],
)
def test_impossible_layouts_name_the_field(par, field):
    gpus = par.pop("gpusPerNode", None)
    raw = {"runtime": "native", "model": {"path": "/models/m"}, "parallelism": par}
    if gpus:
        raw["gpusPerNode"] = gpus
    problems = validate(raw)
    assert field in [p.field for p in problems], problems
    assert all(p.message for p in problems)


def _nodes(*names: str, gpus: int = 8, **kw) -> list[NodeInfo]:
    return [NodeInfo(name=n, gpus=gpus, **kw) for n in names]


def test_ranks_are_stable_across_unrelated_churn():
    spec = _spec(tensor=16, nodes=2)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    first = place([], _nodes("n-c", "n-a", "n-b"), typed)
    assert first.nodes == ("n-a", "n-b")
    # New nodes that sort first join, one unrelated node leaves: the ranks stay.
    second = place(list(first.nodes), _nodes("a-new", "n-a", "n-b", "0-new"), typed)
    assert second.nodes == ("n-a", "n-b") and not second.replaced
    # A placed node goes NotReady: its rank goes to a spare, the survivor keeps its rank.
    nodes = [*_nodes("a-new", "n-b"), NodeInfo("n-a", gpus=8, ready=False)]
    third = place(list(first.nodes), nodes, typed)
    assert third.nodes == ("a-new", "n-b") and third.replaced == ("n-a",)


def test_not_enough_nodes_counts_reasons():
    spec = _spec(tensor=8, data=2, nodes=4)
    spec["placement"]["nodeSelector"] = {"pool": "gpu"}
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    nodes = [
        NodeInfo("a", labels={"pool": "gpu"}, gpus=4),
        NodeInfo("b", labels={"pool": "gpu"}, gpus=2),
        NodeInfo("c", labels={"pool": "cpu"}, gpus=4),
        NodeInfo("d", labels={"pool": "gpu"}, gpus=4, ready=False),
        NodeInfo(
            "e",
            labels={"pool": "gpu"},
            gpus=4,
            taints=({"key": "dedicated", "value": "x", "effect": "NoSchedule"},),
        ),
    ]
    result = place([], nodes, typed)
    assert not result.schedulable and result.eligible == 1
    assert result.reasons == {
        "NotEnoughGPUs": 1,
        "NodeSelectorMismatch": 1,
        "NotReady": 1,
        "TaintNotTolerated": 1,
    }


def test_tolerations_affinity_and_gpu_sources():
    spec = _spec(tensor=1)
    spec["placement"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    spec["placement"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}
                ]
            }
        }
    }
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    node = NodeInfo.from_node(
        {
            "metadata": {"name": "g", "labels": {"zone": "z1", "nvidia.com/gpu.count": "2"}},
            "spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    assert node.gpus == 2 and node.ready
    assert ineligible_reason(node, typed) is None
    other = NodeInfo.from_node(
        {
            "metadata": {"name": "h", "labels": {"zone": "z2"}},
            "status": {
                "allocatable": {"nvidia.com/gpu": "8"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )
    assert other.gpus == 8
    assert ineligible_reason(other, typed) == "AffinityMismatch"


def test_cpu_device_needs_no_gpus():
    spec = with_defaults(
        {"runtime": "native", "device": "cpu", "model": {"path": "/models/m"}}, "ns", "c"
    )
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    assert ineligible_reason(NodeInfo("cpu-node", gpus=0), typed) is None


TAINTS = [
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/not-ready", "NoSchedule"),  # seen: placed, real DESIRED 0
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoSchedule"),
    ("node.kubernetes.io/network-unavailable", "NoSchedule"),  # hostNetwork pods only
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ("dedicated", "NoSchedule"),
    ("dedicated", "PreferNoSchedule"),
]


@pytest.mark.parametrize(("key", "effect"), TAINTS, ids=[f"{k}:{e}" for k, e in TAINTS])
def test_item5_placement_tolerates_exactly_what_the_daemonset_controller_adds(key, effect):
    """Item 5: a node is eligible iff the real agent pod would tolerate its taint.

    The agent pod's tolerations are the DaemonSet's plus those the DaemonSet controller adds
    (AddOrUpdateDaemonPodTolerations: not-ready/unreachable NoExecute only, network-unavailable
    only for hostNetwork pods, which agents are not), matched by ToleratesTaint.
    """
    spec = _spec(tensor=8)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    doc = resources.plan(cache, typed, ["n"], epoch=1)
    ds = resources.daemonset(cache, doc.spec, doc, ["n"], resources.AgentOptions())
    pod = ds["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork")
    real_pod = {
        "tolerations": [*pod["tolerations"], *apirules.daemonset_controller_tolerations(False)]
    }
    taint = {"key": key, "value": "", "effect": effect}
    node = NodeInfo("n", gpus=8, taints=(taint,))
    eligible = ineligible_reason(node, typed) is None
    assert eligible is apirules.schedulable_despite([taint], real_pod)
