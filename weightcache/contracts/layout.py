"""One parallel layout, from the WeightCache spec to a launcher's argv.

The spec's `parallelism`, the plan's `layout` and the launchers' parallel flags describe the
same thing: how many tensor- and data-parallel ranks a group has, over how many nodes, and
which block of them one node serves. `Layout` is that thing with one Python name per concept;
the CRD keeps its camelCase field names (`tensor`, `data`, `dataLocal`, `expert`, `nodes`) and
argv keeps vLLM's flag names (`--tensor-parallel-size`, `--data-parallel-size`, ...), and this
module is the one place that maps between them.

`local_ranks()` follows vLLM's rule (`plan_local_ranks` in its weight cache daemon), so a
launcher started with the engine's own parallel flags serves exactly the shards the engine's
workers on this node expect; `tests/conformance` checks it against vLLM's code.

Torch-free and pure, so the operator, the agent and the launchers check a layout before
starting anything.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from weightcache.contracts.ranks import LocalRank, RankLayoutError, block_ranks

# vLLM's flag names and short aliases (vllm/engine/arg_utils.py, EngineArgs.add_cli_args).
TENSOR_FLAG = "--tensor-parallel-size"
DATA_FLAG = "--data-parallel-size"
DATA_LOCAL_FLAG = "--data-parallel-size-local"
DATA_START_FLAG = "--data-parallel-start-rank"
NODES_FLAG = "--nnodes"
NODE_RANK_FLAG = "--node-rank"
EXPERT_FLAG = "--enable-expert-parallel"


@dataclass(frozen=True)
class Layout:
    """A group's parallel layout, and where one node sits in it.

    `data` counts every data-parallel rank of the group; `data_local` and `data_start` are
    vLLM's DP placement flags (None: not given; with `nodes > 1` they are implied by
    `node_rank` and, when given, must agree).
    """

    tensor: int = 1
    data: int = 1
    nodes: int = 1
    node_rank: int = 0
    data_local: int | None = None
    data_start: int | None = None
    expert: bool = False

    @property
    def world_size(self) -> int:
        """Ranks in the whole group: DP ranks times TP ranks."""
        return self.tensor * self.data

    @property
    def ranks_per_node(self) -> int:
        """Ranks each node serves when the world is split evenly over `nodes`."""
        return self.world_size // self.nodes

    def replicas_per_node(self, gpus_per_node: int) -> int:
        """Whole copies of the per-node block a node of `gpus_per_node` GPUs holds.

        Only a one-node dense group is replicated to fill its node: an expert-parallel layout
        cannot be, and a multi-node group uses exactly its ranks per node.
        """
        if self.expert or self.nodes != 1:
            return 1
        return gpus_per_node // self.ranks_per_node

    def filled(self, gpus_per_node: int) -> Layout:
        """The layout the daemons are launched with: filler replicas counted as DP ranks,
        the way vLLM places data parallelism, so every GPU follows `node_rank * local + i`."""
        replicas = self.replicas_per_node(gpus_per_node)
        if replicas == 1:
            return self
        return replace(
            self,
            data=self.data * replicas,
            data_local=None if self.data_local is None else self.data_local * replicas,
        )

    def on_node(self, node_rank: int) -> Layout:
        """This group's layout as node `node_rank` sees it."""
        return replace(self, node_rank=node_rank)

    @property
    def node_data_start(self) -> int:
        """vLLM's `--data-parallel-start-rank` of this node: the DP rank of its first device."""
        return self.node_rank * self.ranks_per_node // self.tensor

    def local_ranks(self) -> list[LocalRank]:
        """Every local rank of this node in device order; raise `RankLayoutError` naming the
        flag to fix.

        - global ranks enumerate DP, then TP: `global = dp_rank * tp + tp_rank`;
        - with `nodes > 1` node `r` serves the contiguous block `r * local + i`,
          `local = world / nodes`;
        - otherwise the node serves `data_local` DP ranks from `data_start`, so local device
          `i` is DP rank `start + i // tp`, TP rank `i % tp`.
        """
        tp, dp = self.tensor, self.data
        nnodes, node_rank = self.nodes, self.node_rank
        dp_local, dp_start = self.data_local, self.data_start
        _at_least(TENSOR_FLAG, tp, 1)
        _at_least(DATA_FLAG, dp, 1)
        _at_least(NODES_FLAG, nnodes, 1)
        if not 0 <= node_rank < nnodes:
            raise RankLayoutError(
                NODE_RANK_FLAG, f"must be between 0 and {nnodes - 1}, got {node_rank}"
            )
        if dp_local is not None:
            _at_least(DATA_LOCAL_FLAG, dp_local, 1)
        if dp_start is not None:
            _at_least(DATA_START_FLAG, dp_start, 0)
        world = dp * tp
        if nnodes > 1:
            if world % nnodes:
                raise RankLayoutError(
                    NODES_FLAG,
                    f"{nnodes} nodes do not split the world of {world} ranks "
                    f"({DATA_FLAG} {dp} x {TENSOR_FLAG} {tp}) evenly",
                )
            local = world // nnodes
            if tp > local and tp % local:
                raise RankLayoutError(
                    TENSOR_FLAG,
                    f"a tensor-parallel group of {tp} must span whole nodes of {local} ranks",
                )
            if tp <= local and local % tp:
                raise RankLayoutError(
                    TENSOR_FLAG,
                    f"{local} ranks per node do not hold a whole number of tensor-parallel "
                    f"groups of {tp}",
                )
            base = node_rank * local
            # The DP placement flags are implied by --nnodes; given too, they must agree.
            if dp_local is not None and dp_local != max(local // tp, 1):
                raise RankLayoutError(
                    DATA_LOCAL_FLAG,
                    f"node {node_rank} of {nnodes} holds {max(local // tp, 1)} data-parallel "
                    f"rank(s), not {dp_local}",
                )
            if dp_start is not None and dp_start != base // tp:
                raise RankLayoutError(
                    DATA_START_FLAG,
                    f"node {node_rank} of {nnodes} starts at data-parallel rank {base // tp}, "
                    f"not {dp_start}",
                )
        else:
            dp_local = dp if dp_local is None else dp_local
            dp_start = 0 if dp_start is None else dp_start
            if dp_start + dp_local > dp:
                flag = DATA_START_FLAG if dp_start else DATA_LOCAL_FLAG
                raise RankLayoutError(
                    flag,
                    f"{DATA_START_FLAG} {dp_start} + {DATA_LOCAL_FLAG} "
                    f"{dp_local} exceeds {DATA_FLAG} {dp}",
                )
            local = dp_local * tp
            base = dp_start * tp
        return block_ranks(base, local, tp)

    def to_args(self) -> list[str]:
        """vLLM's parallel flags for this layout; flags at their default are left out."""
        out = [TENSOR_FLAG, str(self.tensor)]
        if self.data != 1:
            out += [DATA_FLAG, str(self.data)]
        if self.data_local is not None:
            out += [DATA_LOCAL_FLAG, str(self.data_local)]
        if self.data_start is not None:
            out += [DATA_START_FLAG, str(self.data_start)]
        if self.nodes != 1 or self.node_rank != 0:
            out += [NODES_FLAG, str(self.nodes), NODE_RANK_FLAG, str(self.node_rank)]
        if self.expert:
            out.append(EXPERT_FLAG)
        return out

    def describe(self) -> str:
        """The flags as one line, for messages that tell a person which layout failed."""
        return " ".join(self.to_args())

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Declare the parallel flags, vLLM's names, short aliases and defaults, once.

        The attributes are vLLM's too (`tensor_parallel_size`, ...); `from_args` reads them.
        """
        parser.add_argument(TENSOR_FLAG, "-tp", type=int, default=1,
                            help="tensor-parallel size: one rank per local device, each "
                                 "holding its shard")
        parser.add_argument(DATA_FLAG, "-dp", type=int, default=1,
                            help="data-parallel replicas in the whole group (a dense model's "
                                 "replicas hold identical shards)")
        parser.add_argument(DATA_LOCAL_FLAG, "-dpl", type=int, default=None,
                            help="data-parallel ranks this launcher serves (default: all of "
                                 "them, or what --nnodes implies)")
        parser.add_argument(DATA_START_FLAG, "-dpr", type=int, default=None,
                            help="data-parallel rank of this launcher's first local device")
        parser.add_argument(NODES_FLAG, "-n", type=int, default=1,
                            help="nodes the group spans; node r serves global ranks r*local+i")
        parser.add_argument(NODE_RANK_FLAG, "-r", type=int, default=0,
                            help="this node's index, 0-based")
        parser.add_argument(EXPERT_FLAG, "-ep", action="store_true",
                            help="expert parallelism (vLLM's flag; shards stay tensor-parallel)")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Layout:
        """The layout a parser built by `add_arguments` parsed."""
        return cls(
            tensor=ns.tensor_parallel_size,
            data=ns.data_parallel_size,
            nodes=ns.nnodes,
            node_rank=ns.node_rank,
            data_local=ns.data_parallel_size_local,
            data_start=ns.data_parallel_start_rank,
            expert=bool(ns.enable_expert_parallel),
        )


def _at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise RankLayoutError(flag, f"must be >= {minimum}, got {value}")
