"""Compatibility names of the rank layout, which now lives in `weightcache.contracts.layout`.

`ParallelFlags` and `plan_local_ranks` are the launcher's older spelling of
`Layout(...).local_ranks()`; they stay importable until every caller uses `Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightcache.contracts.layout import (
    Layout,
    LocalRank,
    RankLayoutError,
    block_ranks,
    data_start_rank,
    node_ranks,
)

__all__ = [
    "LocalRank",
    "ParallelFlags",
    "RankLayoutError",
    "block_ranks",
    "data_start_rank",
    "node_ranks",
    "plan_local_ranks",
]


@dataclass(frozen=True)
class ParallelFlags:
    """The launcher's parallel flags under vLLM's attribute names (None: not given)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None

    def layout(self) -> Layout:
        return Layout(
            tensor=self.tensor_parallel_size,
            data=self.data_parallel_size,
            nodes=self.nnodes,
            node_rank=self.node_rank,
            data_local=self.data_parallel_size_local,
            data_start=self.data_parallel_start_rank,
        )

    def describe(self) -> str:
        return self.layout().describe()


def plan_local_ranks(flags: ParallelFlags) -> list[LocalRank]:
    """`flags.layout().local_ranks()`."""
    return flags.layout().local_ranks()
