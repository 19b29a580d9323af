"""The alignment benchmark's device-plugin model reproduces go-gpuallocator's own test cases.

Expected allocations are those of NVIDIA/go-gpuallocator gpuallocator/besteffort_test.go
(TestBestEffortAllocate and TestBestEffortDGX1VoltaGPUAlloc{Two,Four}) on its DGX-1 Volta
topology (common_test.go NewDGX1VoltaNode); the kubelet asks the NVIDIA device plugin for a
preferred allocation and the plugin answers with this policy (NVIDIA/k8s-device-plugin
internal/plugin/server.go, getPreferredAllocation -> alignedAlloc).
"""

from __future__ import annotations

import pytest

from weightcache.bench import alignment as bench


@pytest.mark.parametrize(("available", "size", "expected"), [
    ([0, 2, 4, 5], 2, {4, 5}),  # "Single NVLINK, prefer same switch"
    ([0, 4, 5, 6], 2, {5, 6}),  # "Single NVLINK, prefer same socket"
    ([0, 3, 1], 2, {0, 3}),  # "Prefer dual NVLINK same socket"
    ([0, 1, 4], 2, {0, 4}),  # "Prefer dual NVLINK cross socket"
])
def test_policy_cases(available: list[int], size: int, expected: set[int]) -> None:
    assert set(bench.best_effort(available, size, bench.dgx1_volta_score)) == expected


@pytest.mark.parametrize(("size", "sequence"), [
    (2, [{0, 3}, {1, 2}, {4, 7}, {5, 6}]),
    (4, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
])
def test_sequential_allocations(size: int, sequence: list[set[int]]) -> None:
    free = set(range(8))
    for expected in sequence:
        got = set(bench.best_effort(sorted(free), size, bench.dgx1_volta_score))
        assert got == expected
        free -= got


def test_interleaved_layout_covers_every_fresh_node_allocation() -> None:
    """Why the planner's layout (GPU g holds tp_rank g % tp): on every modelled topology,
    filling an empty node with TP engines gives each one a complete set of shards."""
    for score in bench.TOPOLOGIES.values():
        for tp in (2, 4):
            free = set(range(8))
            while free:
                got = bench.best_effort(sorted(free), tp, score)
                assert {bench.interleaved(g, tp) for g in got} == set(range(tp))
                free -= set(got)


def test_section_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--events", "200"]) == 0
    out = capsys.readouterr().out
    row = "| TP2 | every allocation | interleaved (ours) | 28 | 57.1% | 78.6% | 35.7% | 57.1% |"
    assert row in out
    assert "| TP4 | every allocation | interleaved (ours) | 70 |" in out
