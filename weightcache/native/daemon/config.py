"""What one daemon rank is started with, typed from its argv, and how its start-up refuses.

The launcher starts each rank as `python -m weightcache.native.daemon` with the flags below;
`RankConfig.from_args` turns them into one frozen value that every step of `rank.run` reads,
so no step passes state through the argparse namespace. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from weightcache.contracts.vocabulary import (
    EXIT_BAD_INPUT,
    ROLE_ALIASES,
    ROLE_TARGET,
    ROLES,
    canonical_role,
)
from weightcache.errors import ProjectError

from ..shared.flags import add_allow_uid_flag, add_shard_flags, shard_rules
from ..shared.gpu import GpuError, normalize_uuid

# Test hook: hold the shard loaded but unbound for this long, to observe the loading window.
BIND_DELAY_ENV = "WEIGHTCACHE_DEBUG_BIND_DELAY_S"


class RankRefused(ProjectError):
    """A step of the rank's start refused; `code` is the rank's exit code (docs/native.md)."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RankConfig:
    model: str
    tp_size: int
    tp_rank: int
    global_rank: int  # where this rank sits in the whole group: reported, not fingerprinted
    dp_rank: int
    device: str
    device_index: int
    socket_dir: str | None
    shard_rules: list[str] | None  # None: the preset; []: replicate every tensor
    dtype: str
    role: str  # canonical (aliases resolved)
    transport: str | None
    allowed_uids: tuple[int, ...]  # besides our own
    parent_pid: int | None
    local_ranks: int = 1  # ranks the launcher runs on this node: they share the early reads' memory
    # The launcher's word for this device's UUID: the socket's name and lock before the rank's
    # own CUDA start, checked against the device once it has a context (loading.open_device).
    device_uuid: str | None = None
    # The launcher's head start (headstart.py): the budget it asked the disk for the
    # checkpoint's first bytes within, before this rank ran; the early reads leave those
    # jobs (`headstart.extents`) to the fill.
    head_start_bytes: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RankConfig:
        """The parsed flags, checked; RankRefused (exit 2) for a rank that cannot exist."""
        tp, rank = args.tensor_parallel_size, args.rank
        if tp < 1 or not 0 <= rank < tp:
            raise RankRefused(f"bad rank {rank} for tensor-parallel-size {tp}")
        index = rank if args.device_index is None else args.device_index
        global_rank = rank if args.global_rank is None else args.global_rank
        if index < 0 or global_rank < 0 or args.dp_rank < 0:
            raise RankRefused(f"bad device index {index} / global rank {global_rank} / dp rank "
                              f"{args.dp_rank}")
        device_uuid = None
        if args.device_uuid is not None:
            try:
                device_uuid = normalize_uuid(args.device_uuid)
            except GpuError:
                raise RankRefused(f"--device-uuid {args.device_uuid!r}: not a GPU UUID") from None
            if args.device != "cuda":
                raise RankRefused("--device-uuid names a GPU: it needs --device cuda")
        if args.head_start_bytes < 0:
            raise RankRefused(f"--head-start-bytes {args.head_start_bytes}: use 0 or more")
        return cls(
            model=args.model, tp_size=tp, tp_rank=rank, global_rank=global_rank,
            dp_rank=args.dp_rank, device=args.device, device_index=index,
            socket_dir=args.weight_cache_socket_dir, shard_rules=shard_rules(args),
            dtype=args.dtype, role=canonical_role(args.role), transport=args.transport,
            allowed_uids=tuple(args.allow_uid), parent_pid=args.parent_pid,
            local_ranks=max(1, args.local_ranks), device_uuid=device_uuid,
            head_start_bytes=args.head_start_bytes,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m weightcache.native.daemon",
                                description="One daemon rank (started by weightcache preload).")
    add_shard_flags(p, model_help="safetensors checkpoint directory",
                    tp_help="tensor-parallel size of the group",
                    dtype_help="dtype the tensors are cached in",
                    rules_help="split tensors matching REGEX along DIM (default: Llama)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (the shard)")
    # Where this rank sits in the whole group; reported, not fingerprinted: a dense model's
    # data-parallel replicas hold identical shards.
    p.add_argument("--global-rank", type=int, default=None)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--device-index", type=int, default=None)
    p.add_argument("--device-uuid", default=None,
                   help="the device's UUID as the launcher's driver query gave it")
    p.add_argument("--weight-cache-socket-dir", default=None)
    p.add_argument("--role", choices=(*ROLES, *ROLE_ALIASES), default=ROLE_TARGET)
    p.add_argument("--transport", default=None)
    add_allow_uid_flag(p)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--local-ranks", type=int, default=1,
                   help="ranks on this node (the early reads' host memory is shared by them)")
    p.add_argument("--head-start-bytes", type=int, default=0,
                   help="the budget of the launcher's head start: the checkpoint's first "
                        "bytes it asked the disk for (the early reads leave them to the fill)")
    return p
