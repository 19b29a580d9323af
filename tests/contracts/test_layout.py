"""The one parallel layout type: its flags round-trip, and its ranks follow vLLM's rule."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightcache.contracts.layout import Layout, RankLayoutError

sizes = st.integers(min_value=-2, max_value=64)
optional = st.none() | st.integers(min_value=-2, max_value=64)
layouts = st.builds(
    Layout,
    tensor=sizes,
    data=sizes,
    nodes=sizes,
    node_rank=sizes,
    data_local=optional,
    data_start=optional,
    expert=st.booleans(),
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    Layout.add_arguments(parser)
    return parser.parse_args(argv)


@given(layouts)
def test_flags_round_trip(layout: Layout) -> None:
    assert Layout.from_args(parse(layout.to_args())) == layout


@given(layouts)
def test_describe_is_the_flags_on_one_line(layout: Layout) -> None:
    assert layout.describe() == " ".join(layout.to_args())


def test_no_flags_is_the_default_layout() -> None:
    assert Layout.from_args(parse([])) == Layout()
    assert Layout().to_args() == ["--tensor-parallel-size", "1"]


def test_short_aliases_are_vllms() -> None:
    ns = parse(["-tp", "4", "-dp", "2", "-dpl", "1", "-dpr", "1", "-n", "2", "-r", "1", "-ep"])
    assert Layout.from_args(ns) == Layout(
        tensor=4, data=2, nodes=2, node_rank=1, data_local=1, data_start=1, expert=True
    )


def test_error_names_the_flag() -> None:
    with pytest.raises(RankLayoutError) as exc:
        Layout(tensor=3, data=1, nodes=2).local_ranks()
    assert exc.value.flag == "--nnodes"


def test_multi_node_blocks() -> None:
    ranks = Layout(tensor=4, nodes=2, node_rank=1).local_ranks()
    assert [(r.global_rank, r.tp_rank, r.dp_rank) for r in ranks] == [(2, 2, 0), (3, 3, 0)]


def test_filler_replicas_count_as_data_parallel_ranks() -> None:
    layout = Layout(tensor=2, data=1, data_local=1)
    assert layout.replicas_per_node(8) == 4
    assert layout.filled(8) == Layout(tensor=2, data=4, data_local=4)
    assert Layout(tensor=2, expert=True).replicas_per_node(8) == 1
    assert Layout(tensor=2, data=2, nodes=2).replicas_per_node(8) == 1


def test_node_data_start() -> None:
    layout = Layout(tensor=2, data=4, nodes=2)
    assert [layout.on_node(r).node_data_start for r in (0, 1)] == [0, 2]
    assert layout.ranks_per_node == 4 and layout.world_size == 8
