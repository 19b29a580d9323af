"""The alignment decision (weightcache.contracts.alignment) on simulated GPU UUIDs.

The rule these tests encode is vLLM's: worker `local_rank` runs on `cuda:i` where `i` is the
position of its logical device in CUDA_VISIBLE_DEVICES (vLLM 0.33, vllm/v1/worker/
gpu_worker.py `init_device` -> `logical_device_id_to_visible_device_id`, and
vllm/platforms/interface.py `device_id_to_physical_device_id`, which reads the i-th entry and
accepts GPU UUIDs through NVML in vllm/platforms/cuda.py). Logical ids of a pod running
`--data-parallel-size-local d` are `local_rank + dp_local_rank * world_size`
(vllm/config/parallel.py `get_local_gpu_index`). So "rank j hits" means: the GPU at position j
of our order holds tp_rank `j % tp`.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from weightcache.contracts import alignment as al
from weightcache.contracts.layout import Layout


def uuids(n: int) -> list[str]:
    return [f"GPU-{i:02x}00aaaa-0000-1111-2222-33334444{i:04x}" for i in range(n)]


def node_map(gpus: int, tp: int) -> dict[str, al.Holding]:
    """The daemons' layout on one node filled with TP replicas (the project's rank formula)."""
    layout = Layout(tensor=tp, data=gpus // tp)
    ids = uuids(gpus)
    return {
        ids[r.local]: al.Holding(uuid=ids[r.local], tp_rank=r.tp_rank, tp_size=tp,
                                 dp_rank=r.dp_rank, replica=r.local // tp,
                                 global_rank=r.global_rank, sockets={"target": "x.sock"})
        for r in layout.local_ranks()
    }


def vllm_device_of(order: tuple[str, ...], local_rank: int) -> str:
    """vLLM's cuda:i for logical id i: the i-th CUDA_VISIBLE_DEVICES entry."""
    return order[local_rank]


def test_issue_example_gpus_1_2_are_swapped() -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    a = al.align([ids[1], ids[2]], gpus, 2)
    assert a.order == (ids[2], ids[1])
    assert a.result == "aligned" and a.hits == 2
    for rank in range(2):
        assert gpus[vllm_device_of(a.order, rank)].tp_rank == rank


def test_before_alignment_the_same_allocation_misses_both_ranks() -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    plain = [ids[1], ids[2]]  # the order the container enumerates them in
    assert [gpus[plain[r]].tp_rank == r for r in range(2)] == [False, False]


def test_partial_names_the_missing_rank() -> None:
    gpus = node_map(8, 4)
    ids = uuids(8)
    a = al.align([ids[1], ids[2], ids[3], ids[5]], gpus, 4)
    assert a.result == "partial" and a.hits == 3
    assert [gpus[a.order[r]].tp_rank for r in range(1, 4)] == [1, 2, 3]
    (miss,) = a.misses()
    assert (miss.local, miss.want_tp, miss.uuid, miss.held_tp) == (0, 0, ids[5], 1)
    text = al.describe(a)
    assert "rank 0 (tp_rank 0)" in text and ids[5] in text and "tp_rank 1" in text


def test_nothing_matches_keeps_visible_order() -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    other = ["GPU-ffff0000-0000-0000-0000-000000000001", ids[0]]
    a = al.align([ids[0], ids[2]], gpus, 2)  # both hold tp_rank 0: rank 0 hits only
    assert a.result == "partial" and a.order[0] in (ids[0], ids[2])
    b = al.align(other, gpus, 4)  # cache is TP2, engine TP4: no GPU holds its shards
    assert b.order == tuple(other) and b.result == "missed"


def test_replica_preferred_among_equal_candidates() -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    # DP2 x TP2 in one pod given GPUs 0..3 in a scrambled order: each group stays on a replica.
    a = al.align([ids[3], ids[0], ids[2], ids[1]], gpus, 2, dp_local=2)
    assert a.result == "aligned"
    assert {gpus[a.order[0]].replica} == {gpus[a.order[1]].replica}
    assert {gpus[a.order[2]].replica} == {gpus[a.order[3]].replica}


def test_expert_parallel_matches_dp_rank_too() -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    # dp ranks of GPUs 0..7: 0,0,1,1,2,2,3,3. An EP engine at DP rank 2 needs GPUs 4 and 5.
    a = al.align([ids[1], ids[4], ids[5], ids[0]], gpus, 2, dp_start=2)
    assert a.order[:2] == (ids[4], ids[5]) and a.result == "aligned"
    b = al.align([ids[0], ids[1]], gpus, 2, dp_start=2)
    assert b.result == "missed"


def optimum(visible: list[str], gpus: dict[str, al.Holding], tp: int, dp_local: int) -> int:
    """Largest number of ranks any order can serve from the cache (per-shard counting)."""
    wanted = Counter(j % tp for j in range(min(len(visible), tp * dp_local)))
    have = Counter(gpus[u].tp_rank for u in visible if u in gpus and gpus[u].tp_size == tp)
    return sum(min(n, have[k]) for k, n in wanted.items())


@pytest.mark.parametrize(("tp", "dp_local"), [(1, 1), (2, 1), (4, 1), (2, 2), (8, 1)])
def test_every_ordered_allocation_gets_the_optimal_hits(tp: int, dp_local: int) -> None:
    """Exhaustive over the ordered GPU sets of an 8-GPU node (8!/(8-n)! each, <= 1680 here;
    TP8 takes one order per set: every permutation of all 8 GPUs holds the same shards)."""
    gpus = node_map(8, tp)
    size = tp * dp_local
    allocations = (
        [tuple(uuids(8))[::-1]] if size == 8 else itertools.permutations(uuids(8), size)
    )
    for visible in allocations:
        a = al.align(list(visible), gpus, tp, dp_local=dp_local)
        assert sorted(a.order) == sorted(visible)  # a permutation: no GPU added or lost
        assert a.hits == optimum(list(visible), gpus, tp, dp_local)
        for r in a.ranks:  # each claimed hit is a real one by vLLM's rule
            assert r.hit == (gpus[vllm_device_of(a.order, r.local)].tp_rank == r.local % tp)


def test_every_covering_allocation_is_fully_aligned() -> None:
    for tp in (2, 4):
        gpus = node_map(8, tp)
        for combo in itertools.combinations(uuids(8), tp):
            covers = {gpus[u].tp_rank for u in combo} == set(range(tp))
            assert (al.align(list(combo), gpus, tp).result == "aligned") == covers


def test_map_round_trip_and_validation() -> None:
    gpus = node_map(4, 2)
    doc = al.build_map({"cache": "llama", "tpSize": 2}, list(gpus.values()))
    parsed = al.parse_map(json.dumps(doc))
    assert parsed.gpus == gpus and parsed.identity["cache"] == "llama"
    bad = json.loads(json.dumps(doc))
    first = next(iter(bad["gpus"]))
    bad["gpus"][first]["tpRank"] = 2
    with pytest.raises(al.MapError, match="tpRank 2 is not below tpSize 2"):
        al.parse_map(json.dumps(bad))
    bad["gpus"][first] = {**doc["gpus"][first], "sockets": {"target": "../evil.sock"}}
    with pytest.raises(al.MapError, match="sockets"):
        al.parse_map(json.dumps(bad))
    with pytest.raises(al.MapError, match="version"):
        al.parse_map(json.dumps({**doc, "version": 9}))
    with pytest.raises(al.MapError, match="bytes"):
        al.parse_map(b" " * (al.MAX_MAP_BYTES + 1))


def test_visible_from_env_and_smi() -> None:
    ids = uuids(2)
    assert al.visible_from_env(",".join(ids)) == ids
    assert al.visible_from_env("all") is None and al.visible_from_env("0,1") is None
    assert al.visible_from_smi(f"{ids[1]}\n\n{ids[0]}\n[N/A]\n") == [ids[1], ids[0]]


def test_native_client_rank_devices(tmp_path) -> None:
    from weightcache.native.engine import rank_devices as native

    gpus = node_map(8, 4)
    ids = uuids(8)
    (tmp_path / al.MAP_NAME).write_text(json.dumps(al.build_map({}, list(gpus.values()))))
    visible = [ids[6], ids[4], ids[7], ids[5]]  # this process's cuda:0..3
    devices = native.rank_devices(4, socket_dir=tmp_path, visible=visible, report=False)
    assert devices == [1, 3, 0, 2]  # tp_rank r attaches on cuda:devices[r]
    assert [gpus[visible[d]].tp_rank for d in devices] == [0, 1, 2, 3]
    missing = tmp_path / "none"
    assert native.rank_devices(4, socket_dir=missing, visible=visible) == [0, 1, 2, 3]


def test_uuid_spellings_match_the_agents_canonical_form() -> None:
    from weightcache.native.shared.gpu import normalize_uuid

    for raw in ("GPU-3F0C1A2B-1111-2222-3333-444455556666", "3f0c1a2b111122223333444455556666",
                "GPU-3f0c1a2b-1111-2222-3333-444455556666"):
        assert al.canonical(raw) == normalize_uuid(raw)  # one rule, two homes, kept equal
    gpus = node_map(8, 2)
    ids = uuids(8)
    shouted = [ids[3].upper(), ids[0].upper()]
    a = al.align(shouted, gpus, 2)
    assert a.result == "aligned" and a.order == (shouted[1], shouted[0])  # container's strings
