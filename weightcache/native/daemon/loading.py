"""One rank's load, once it holds its socket's lock: device, plan, arena, fill (+ digest), seal.

`rank.run` imports this module only after taking the lock, because it imports torch (seconds):
a second daemon for the same device must fail before that. Each step is a function of its own;
`load` runs them in order and times each (`PhaseClock`, READY's `phases`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightcache.contracts.vocabulary import EXIT_ERROR

from ..shared import content as content_mod
from ..shared.checkpoint import Checkpoint
from ..shared.coldload import LoadStats
from ..shared.earlyread import EarlyReads
from ..shared.identity import device_identity
from ..shared.loader import ArenaLayout, load_into_arena
from ..shared.rankplan import plan_rank_shard
from ..shared.sharding import ShardingError, ShardRule
from ..shared.transport import Arena, Transport, default_transport, get_transport
from .config import BIND_DELAY_ENV, RankConfig, RankRefused
from .progress import Counter, PhaseClock, Ticker, emit

log = logging.getLogger("weightcache.daemon")

LOADING_INTERVAL_S = 0.5  # how often a loading rank reports its bytes on stdout


@dataclass
class LoadedShard:
    """A rank's shard, loaded and sealed, ready to be served."""

    arena: Arena
    transport: Transport
    layout: ArenaLayout
    fingerprint: dict[str, Any]  # with the full content digest
    record: dict[str, content_mod.FileDigest]
    device: torch.device
    load_seconds: float  # allocate + fill, as SERVING reports it
    loader: LoadStats
    early: dict[str, Any] | None  # what the reads made while the rank started did


def load(config: RankConfig, ckpt: Checkpoint, rules: list[ShardRule], socket: Path,
         clock: PhaseClock, early: EarlyReads | None) -> LoadedShard:
    device = open_device(config, clock)
    if early is not None and early.disk is not None:
        early.disk.ignore_own()  # torch and the device are up: the rank's start is over
    layout, fingerprint = plan(config, ckpt, rules)
    drop_stale_socket(socket)
    clock.mark("plan_seconds")
    t0 = time.monotonic()
    transport = get_transport(config.transport) if config.transport else default_transport(device)
    arena = transport.allocate(layout.nbytes, device)
    try:
        clock.mark("allocate_seconds")
        # Every byte's digest comes from the fill's own reads (coldload hashes the buffers
        # the bytes land in, or takes the early reads' jobs with their digests), bracketed
        # by the files' identities taken before the first read.
        try:
            loader = fill(config, layout, arena, device, ckpt.files, early)
        except content_mod.ContentError as exc:
            raise RankRefused(f"rank {config.tp_rank}: {exc}", EXIT_ERROR) from None
        finally:
            early_stats = early.stats() if early is not None else None
            if early is not None:
                early.close()  # its host memory back now, not when the rank exits
        clock.mark("fill_seconds")  # includes the digest
        record = loader.record or {}
        fingerprint = {**fingerprint, "content": content_mod.content_root(record)}
        load_seconds = time.monotonic() - t0
        delay = float(os.environ.get(BIND_DELAY_ENV, "0") or 0)
        if delay > 0:
            time.sleep(delay)
        arena.export()  # seal / create the handle now, not on the first engine's clock
        clock.mark("export_seconds")
    except BaseException:
        arena.close()
        raise
    return LoadedShard(arena, transport, layout, fingerprint, record, device, load_seconds,
                       loader, early_stats)


def open_device(config: RankConfig, clock: PhaseClock) -> torch.device:
    """The rank's device, with its CUDA context created (and timed) up front."""
    if config.device == "cuda":
        device = torch.device("cuda", config.device_index)
    else:
        device = torch.device("cpu")
    clock.mark("startup_seconds")  # headers, device identity (imports torch on CUDA), lock
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(0, device=device)  # the CUDA context, timed on its own
        check_device_uuid(config)
    clock.mark("cuda_init_seconds")
    return device


def check_device_uuid(config: RankConfig) -> None:
    """The UUID the launcher gave (`--device-uuid`, the socket's name and lock) must be this
    rank's device: checked before a byte is served, since the socket is found by that name.
    A mismatch (an environment that changed between the launcher and the rank) stops the
    rank; the launcher then stops every rank with its exit code."""
    if config.device_uuid is None:
        return
    actual = device_identity(config.device, config.device_index)
    if actual != config.device_uuid:
        raise RankRefused(f"device {config.device_index} is {actual}, not {config.device_uuid} as "
                          "the launcher found it; refusing to serve under the wrong name",
                          EXIT_ERROR)


def plan(config: RankConfig, ckpt: Checkpoint,
         rules: list[ShardRule]) -> tuple[ArenaLayout, dict[str, Any]]:
    """The shard's arena layout and fingerprint; RankRefused if it cannot be served."""
    try:
        layout, fingerprint = plan_rank_shard(ckpt, rules, tp_size=config.tp_size,
                                              tp_rank=config.tp_rank, dtype=config.dtype)
    except ShardingError as exc:
        raise RankRefused(str(exc)) from None
    try:  # a table msgpack cannot encode would make a READY rank that never serves
        layout.digest  # noqa: B018  (computed once here; get_state sends it)
    except (OverflowError, ValueError) as exc:
        raise RankRefused(f"{config.model}: the tensor table cannot be served: {exc}") from None
    return layout, fingerprint


def drop_stale_socket(path: Path) -> None:
    """A socket left by a dead daemon would let clients connect to nothing: drop it first."""
    if os.path.lexists(path):
        with contextlib.suppress(FileNotFoundError):
            if path.is_socket() and not path.is_symlink():
                os.unlink(path)


def fill(config: RankConfig, layout: ArenaLayout, arena: Arena, device: torch.device,
         files: list[Path], early: EarlyReads | None = None) -> LoadStats:
    """Read and digest the shard, reporting `LOADING {json}` every LOADING_INTERVAL_S."""
    done = Counter()
    started = time.monotonic()

    def report() -> None:
        emit("LOADING " + json.dumps({
            "rank": config.global_rank, "bytes_loaded": done.value, "bytes": layout.nbytes,
            "seconds": round(time.monotonic() - started, 3)}))

    ticker = Ticker(report, LOADING_INTERVAL_S).start()
    try:
        # A rank reads every byte it digests once, O_DIRECT where the page cache lacks it.
        # With tensor parallelism each rank digests only the chunks it reads (its engines'
        # claims sample those), but ranks' ranges overlap (a tensor split along an inner
        # dimension is read whole by each): buffered reads let them share one pass of the
        # disk through the page cache. An explicit WEIGHTCACHE_LOAD_DIRECT still wins.
        share = config.tp_size > 1
        direct = None if os.environ.get("WEIGHTCACHE_LOAD_DIRECT") or not share else False
        loaded = load_into_arena(layout, arena.tensor(), progress=done.add, direct=direct,
                                 digest=list(files), share=share, early=early)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        ticker.stop()
    done.add(layout.nbytes - done.value)  # the alignment padding between tensors
    report()
    return loaded
