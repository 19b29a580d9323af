"""Which global, tensor-parallel and data-parallel rank each local device of a node serves.

The rules are vLLM's (`plan_local_ranks` in its weight cache daemon), so a native launcher
started with the engine's own parallel flags serves exactly the shards the engine's workers on
this node expect:
- global ranks enumerate DP, then TP: `global = dp_rank * tp + tp_rank`;
- with `--nnodes N` node `r` serves the contiguous block `r * local + i`, `local = world / N`;
- without it, a launcher serves `--data-parallel-size-local` DP ranks from
  `--data-parallel-start-rank`, so local device `i` is DP rank `start + i // tp`, TP rank `i % tp`.

The operator's planner, the placement plan and the agent use the same formula (`block_ranks`).
Native ranks need no rendezvous: each computes its shard from the checkpoint, so a launcher
only has to know its own block. For a dense model a DP rank does not change the bytes of a
shard; it is reported, not fingerprinted.

Torch-free and pure, so the launcher and the node agent check a layout before starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass


class RankLayoutError(ValueError):
    """A parallel layout no launcher can serve; `flag` names the option to fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class LocalRank:
    """What local device `local` serves."""

    local: int
    global_rank: int
    tp_rank: int
    dp_rank: int


@dataclass(frozen=True)
class ParallelFlags:
    """The launcher's parallel flags, vLLM's names and meaning (None: not given)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None

    def describe(self) -> str:
        parts = [f"--tensor-parallel-size {self.tensor_parallel_size}"]
        if self.data_parallel_size != 1:
            parts.append(f"--data-parallel-size {self.data_parallel_size}")
        if self.data_parallel_size_local is not None:
            parts.append(f"--data-parallel-size-local {self.data_parallel_size_local}")
        if self.data_parallel_start_rank is not None:
            parts.append(f"--data-parallel-start-rank {self.data_parallel_start_rank}")
        if self.nnodes != 1:
            parts.append(f"--nnodes {self.nnodes} --node-rank {self.node_rank}")
        return " ".join(parts)


def _at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise RankLayoutError(flag, f"must be >= {minimum}, got {value}")


def plan_local_ranks(flags: ParallelFlags) -> list[LocalRank]:
    """Every local rank in device order; raise `RankLayoutError` naming the flag to fix."""
    tp, dp = flags.tensor_parallel_size, flags.data_parallel_size
    nnodes, node_rank = flags.nnodes, flags.node_rank
    dp_local, dp_start = flags.data_parallel_size_local, flags.data_parallel_start_rank
    _at_least("--tensor-parallel-size", tp, 1)
    _at_least("--data-parallel-size", dp, 1)
    _at_least("--nnodes", nnodes, 1)
    if not 0 <= node_rank < nnodes:
        raise RankLayoutError("--node-rank", f"must be between 0 and {nnodes - 1}, got {node_rank}")
    if dp_local is not None:
        _at_least("--data-parallel-size-local", dp_local, 1)
    if dp_start is not None:
        _at_least("--data-parallel-start-rank", dp_start, 0)
    world = dp * tp
    if nnodes > 1:
        if world % nnodes:
            raise RankLayoutError(
                "--nnodes",
                f"{nnodes} nodes do not split the world of {world} ranks "
                f"(--data-parallel-size {dp} x --tensor-parallel-size {tp}) evenly",
            )
        local = world // nnodes
        if tp > local and tp % local:
            raise RankLayoutError(
                "--tensor-parallel-size",
                f"a tensor-parallel group of {tp} must span whole nodes of {local} ranks",
            )
        if tp <= local and local % tp:
            raise RankLayoutError(
                "--tensor-parallel-size",
                f"{local} ranks per node do not hold a whole number of tensor-parallel "
                f"groups of {tp}",
            )
        base = node_rank * local
        # The DP placement flags are implied by --nnodes; given too, they must agree.
        if dp_local is not None and dp_local != max(local // tp, 1):
            raise RankLayoutError(
                "--data-parallel-size-local",
                f"node {node_rank} of {nnodes} holds {max(local // tp, 1)} data-parallel "
                f"rank(s), not {dp_local}",
            )
        if dp_start is not None and dp_start != base // tp:
            raise RankLayoutError(
                "--data-parallel-start-rank",
                f"node {node_rank} of {nnodes} starts at data-parallel rank {base // tp}, "
                f"not {dp_start}",
            )
    else:
        dp_local = dp if dp_local is None else dp_local
        dp_start = 0 if dp_start is None else dp_start
        if dp_start + dp_local > dp:
            flag = "--data-parallel-start-rank" if dp_start else "--data-parallel-size-local"
            raise RankLayoutError(
                flag,
                f"--data-parallel-start-rank {dp_start} + --data-parallel-size-local "
                f"{dp_local} exceeds --data-parallel-size {dp}",
            )
        local = dp_local * tp
        base = dp_start * tp
    return block_ranks(base, local, tp)


def block_ranks(base: int, count: int, tp: int) -> list[LocalRank]:
    """The formula: local device `i` serves global rank `base + i`, TP rank `g % tp`, DP `g // tp`.

    The one place it is written: the launcher (`plan_local_ranks`), the operator's planner
    (`placement.node_slots`), the placement plan (`Plan.local_ranks`) and the agent's vllm
    runtime all call it.
    """
    return [
        LocalRank(local=i, global_rank=base + i, tp_rank=(base + i) % tp, dp_rank=(base + i) // tp)
        for i in range(count)
    ]


def node_ranks(node_rank: int, ranks_per_node: int, tp: int) -> list[LocalRank]:
    """The block of node `node_rank` when every node serves `ranks_per_node` ranks."""
    return block_ranks(node_rank * ranks_per_node, ranks_per_node, tp)


def data_start_rank(node_rank: int, ranks_per_node: int, tp: int) -> int:
    """vLLM's `--data-parallel-start-rank` of a node: the DP rank of its first device."""
    return node_rank * ranks_per_node // tp
