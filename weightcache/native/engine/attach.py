"""Client library: get a rank's state dict from the local daemon, or from disk.

An engine calls `load_state_dict(model_dir, device=..., tp_size=..., tp_rank=...)` where it
would otherwise read the checkpoint. The client computes the fingerprint of what it expects
from the checkpoint's headers, checks the socket and the daemon process (owner, uid, device
identity), asks for the state, and maps the arena the daemon passes. When any of that fails and
`fallback` is on, it loads the same shard from disk with the same layout and logs why; with
`fallback` off it raises a specific `WeightCacheError`.

`materialize(module, state_dict)` fills a meta-device module with those tensors, keeping tied
parameters one object.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightcache import constants
from weightcache.contracts.vocabulary import MODES, ROLE_TARGET
from weightcache.errors import ProjectError

from ..shared import coldload, content, plantable
from ..shared import fingerprint as fp
from ..shared import protocol as proto
from ..shared.checkpoint import CheckpointError, RawCheckpoint, open_checkpoint, read_raw
from ..shared.connection import connect, query, raise_for, recv_reply, request, send_request
from ..shared.errors import (
    CacheProtocolError,
    CacheSecurityError,
    DaemonError,
    DaemonLoadingError,
    DaemonUnavailableError,
    DeviceMismatchError,
    DiskFallbackError,
    FingerprintMismatchError,
    NotReadyError,
    ReleasedError,
    WeightCacheError,
)
from ..shared.identity import device_identity
from ..shared.identity import socket_path as derive_socket_path
from ..shared.limits import REQUEST_DEADLINE_S
from ..shared.loader import ArenaLayout, ArenaLayoutError, load_into_arena
from ..shared.rankplan import plan_rank_shard
from ..shared.security import SecurityError, resolve_socket_dir
from ..shared.sharding import ShardingError, parse_rules
from ..shared.transport import TransportError, get_transport
from . import plancache
from .gcpause import gc_paused
from .loading import wait_bound, wait_while_loading

log = logging.getLogger("weightcache.client")


class MissingTensorError(ProjectError, KeyError):
    """materialize(): the module has parameters the state dict does not provide."""


class UnexpectedTensorError(ProjectError, KeyError):
    """materialize(strict=True): the state dict has tensors the module has no place for.

    A checkpoint with more layers than the module (a 4-layer checkpoint into a 3-layer
    model) would otherwise "load" with a quarter of it silently dropped.
    """


@dataclass
class AttachResult:
    state_dict: dict[str, torch.Tensor]
    source: str  # "cache" or "disk"
    reason: str | None
    seconds: float
    nbytes: int
    tensors: int
    mode: str
    socket: str | None
    aliases: dict[str, str] = field(default_factory=dict)
    generation: int | None = None  # the cache's update generation served (None: from disk)
    # Seconds per step of the cache path (plan, sent, hello, get_plan, get_state, map, alloc,
    # copy_queued, views, copy, claimed, release, check): what an attach spends where.
    phases: dict[str, float] = field(default_factory=dict)
    plan: str = ""  # "kept", "shipped" (the daemon's) or "made" (planned here)

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "source": self.source,
            "reason": self.reason,
            "mode": self.mode,
            "socket": self.socket,
        }


# -- options --------------------------------------------------------------------------------
def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean")


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def _pick(explicit: Any, env: Any, default: Any) -> Any:
    if explicit is not None:
        return explicit
    return default if env is None else env


# -- attach ---------------------------------------------------------------------------------
@dataclass
class ExpectedShard:
    """What this engine expects its rank's daemon to serve, bound to the checkpoint itself:
    the layout and fingerprint it will compare the daemon's answer with, and the device
    identity whose socket it asks (not `shared.rankplan`, which plans the shard). The layout
    is its own plan (ArenaLayout) or the daemon's, shipped for this engine's very files
    (plantable.ShippedTable)."""

    layout: ArenaLayout | plantable.ShippedTable
    fingerprint: dict[str, Any]
    identity: str
    device: torch.device
    planned: bool = True  # False: the plan came from this process' cache (plancache.py)
    # A kept plan's claim while its chunks still hash (content.PendingClaim): the attach
    # says hello meanwhile; `claimed()` puts it into the fingerprint before get_state.
    pending: content.PendingClaim | None = None

    def claimed(self) -> dict[str, Any]:
        """The fingerprint with its content claim, waiting for a pending one."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                self.fingerprint = {**self.fingerprint, "content": pending.result()}
            except OSError as exc:
                raise CheckpointError(f"cannot read a checkpoint file: {exc}") from None
        return self.fingerprint

    def unclaimed(self) -> dict[str, Any]:
        """The fingerprint without its content claim (`get_state {claim: "after"}`)."""
        return {k: v for k, v in self.fingerprint.items() if k != "content"}

    @property
    def tensors(self) -> int:
        layout = self.layout
        return len(layout.entries) if isinstance(layout, ArenaLayout) else layout.count

    @property
    def how(self) -> str:
        if not self.planned:
            return "kept"
        return "made" if isinstance(self.layout, ArenaLayout) else "shipped"


@dataclass
class UnplannedShard:
    """No plan yet in this process: what the engine asks its daemon's plan for (`get_plan`),
    and how it would plan itself instead (`plan`)."""

    raw: RawCheckpoint
    key: dict[str, Any]  # plantable.plan_key of this engine's own files
    dtype: str
    identity: str
    device: torch.device
    cache_key: tuple[Any, ...]
    dirs: tuple[Any, ...]
    started_ns: int
    options: dict[str, Any]  # plan_rank's arguments

    def plan(self) -> ExpectedShard:
        return plan_rank(self.raw.path, **self.options)


# Plans of this process, reused while no file they were made from changed (plancache.py).
PLANS = plancache.PlanCache()


def _lookup(model_dir: str | os.PathLike, device: torch.device, device_index: int,
            tp_size: int, tp_rank: int, shard_rules: list[str] | None, dtype: str,
            ) -> tuple[str, tuple[Any, ...], int, tuple[Any, ...]]:
    """(device identity, the plan cache's key, when planning starts, the directory's
    stamps): what planning here and asking the daemon's plan both begin with."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tp_rank {tp_rank} for tp_size {tp_size}")
    identity = device_identity(device.type, device_index)
    key = _plan_key(model_dir, tp_size, tp_rank, shard_rules, dtype)
    return identity, key, plancache.now_ns(), plancache.directory_stamps(Path(model_dir))


def _plan_key(model_dir: str | os.PathLike, tp_size: int, tp_rank: int,
              shard_rules: list[str] | None, dtype: str) -> tuple[Any, ...]:
    """The plan cache's key: the arguments that shape a plan."""
    return (os.path.abspath(model_dir), tp_size, tp_rank,
            None if shard_rules is None else tuple(shard_rules), dtype)


def _kept(key: tuple[Any, ...], dirs: tuple[Any, ...], identity: str,
          device: torch.device, *, own: bool = False) -> ExpectedShard | None:
    """The plan this process keeps for `key` (with `own`: only one it made itself), with a
    fresh content claim; None if none (or a file changed since: then it is dropped)."""
    kept = PLANS.get(key, dirs)
    if kept is None or (own and not isinstance(kept.layout, ArenaLayout)):
        return None
    try:
        claim = content.start_claim(kept.files, coverage=kept.share)
    except OSError:
        claim = None  # a file went away: plan again, which says what is wrong
    if claim is not None and claim.identities == kept.identities:
        return ExpectedShard(kept.layout, dict(kept.fingerprint), identity, device,
                             planned=False, pending=claim)
    PLANS.drop(key)  # a discarded claim closes its files once its reads are done
    return None


def plan_rank(
    model_dir: str | os.PathLike,
    *,
    device: torch.device,
    device_index: int,
    tp_size: int,
    tp_rank: int,
    shard_rules: list[str] | None,
    dtype: str,
    cache: bool = True,
) -> ExpectedShard:
    """What this rank expects, planned here: its layout and fingerprint, with a fresh
    content claim (attach itself asks the daemon's plan first: `expect_rank`).

    With `cache`, a plan made earlier in this process from the very same files is reused
    (plancache.py says when); the claim is sampled anew either way."""
    identity, key, started, dirs = _lookup(model_dir, device, device_index, tp_size, tp_rank,
                                           shard_rules, dtype)
    kept = _kept(key, dirs, identity, device, own=True) if cache else None
    if kept is not None:
        kept.claimed()
        return kept
    rules = parse_rules(shard_rules)
    ckpt = open_checkpoint(model_dir)
    layout, fingerprint = plan_rank_shard(ckpt, rules, tp_size=tp_size, tp_rank=tp_rank,
                                          dtype=dtype)
    # A tensor-parallel rank's daemon digests the chunks its share reads: sample among them.
    share = None if tp_size == 1 else {
        p.name: c for p, c in coldload.share_chunks(list(layout.entries)).items()}
    try:  # a few sampled chunks: the daemon checks them against every byte it loaded
        claim = content.sample_claim(ckpt.files, coverage=share)
    except OSError as exc:
        raise CheckpointError(f"{model_dir}: cannot read: {exc}") from None
    fingerprint["content"] = claim
    if cache:
        PLANS.put(key, plancache.Plan(
            tuple(ckpt.files), dirs, plancache.claimed_identities(claim), layout,
            {k: v for k, v in fingerprint.items() if k != "content"}, share), started)
    return ExpectedShard(layout, fingerprint, identity, device)


def expect_rank(
    model_dir: str | os.PathLike,
    *,
    device: torch.device,
    device_index: int,
    tp_size: int,
    tp_rank: int,
    shard_rules: list[str] | None,
    dtype: str,
) -> ExpectedShard | UnplannedShard:
    """The kept plan (with a fresh claim), or what to ask the daemon's plan for: the raw
    headers' digests, read and hashed but not parsed (about 0.1 us per tensor)."""
    identity, key, started, dirs = _lookup(model_dir, device, device_index, tp_size, tp_rank,
                                           shard_rules, dtype)
    kept = _kept(key, dirs, identity, device)
    if kept is not None:
        return kept
    rules = parse_rules(shard_rules)  # a bad rule is refused here, as when planning
    raw = read_raw(model_dir)
    plan_key = plantable.plan_key(
        checkpoint=fp.raw_checkpoint_hash(raw.header_digests), index=raw.index_digest,
        config=raw.config_digest, tp_size=tp_size, tp_rank=tp_rank,
        shard_rules=fp.rules_hash([r.text for r in rules], tp_size),
        runtime_version=fp.RUNTIME_VERSION)
    return UnplannedShard(raw, plan_key, dtype, identity, device, key, dirs, started, dict(
        device=device, device_index=device_index, tp_size=tp_size, tp_rank=tp_rank,
        shard_rules=shard_rules, dtype=dtype))


def _shipped_table(sock: socket.socket, spec: UnplannedShard) -> plantable.ShippedTable | None:
    """The daemon's plan for these very files, in chunks; None when it ships none for them
    (another config.json, an older update, a table it cannot encode): plan here then."""
    parts: list[bytes] = []
    size = digest = None
    got = 0
    while size is None or got < size:
        reply, _ = request(sock, "get_plan", key=spec.key, dtype=spec.dtype, offset=got)
        if not reply.get("ok") and reply.get("error") in (proto.E_FINGERPRINT_MISMATCH,
                                                         proto.E_NO_PLAN):
            return None
        raise_for(reply)
        data = reply.get("data")
        if size is None:
            size, digest = reply.get("size"), reply.get("digest")
            if not isinstance(size, int) or not 0 < size <= plantable.MAX_PLAN:
                raise CacheProtocolError(f"get_plan: a table of {size!r} bytes")
        if (not isinstance(data, bytes) or not data or reply.get("size") != size
                or reply.get("digest") != digest or reply.get("offset") != got
                or got + len(data) > size):
            raise CacheProtocolError("get_plan: a chunk that does not continue the table")
        parts.append(data)
        got += len(data)
    blob = b"".join(parts)
    if plantable.digest(blob) != digest:
        raise CacheProtocolError("get_plan: the table does not match its digest")
    try:
        return plantable.decode(blob, spec.key)
    except plantable.PlanTableError as exc:
        raise CacheProtocolError(str(exc)) from None


def _plan_here_or_shipped(sock: socket.socket, spec: UnplannedShard) -> ExpectedShard:
    """The daemon's plan bound to this engine's files (`_shipped_table`), with this
    engine's fingerprint and a fresh claim; else this engine's own plan."""
    # Attaches of one process starting together (an engine's threads, a burst) fetch the
    # plan once: the others find it kept when their turn comes. Not for longer than
    # FLIGHT_WAIT_S (well inside the daemon's idle deadline on this connection).
    flight = _flight(spec.cache_key)
    held = flight.acquire(timeout=FLIGHT_WAIT_S)
    try:
        kept = _kept(spec.cache_key, spec.dirs, spec.identity, spec.device)
        if kept is not None:
            return kept
        return _fetch_or_plan(sock, spec)
    finally:
        if held:
            flight.release()


FLIGHT_WAIT_S = REQUEST_DEADLINE_S / 4
_FLIGHTS: dict[tuple[Any, ...], threading.Lock] = {}
_FLIGHTS_LOCK = threading.Lock()


def _flight(key: tuple[Any, ...]) -> threading.Lock:
    with _FLIGHTS_LOCK:
        if len(_FLIGHTS) > 64:  # a process attaches a handful of checkpoints; keep it bounded
            _FLIGHTS.clear()
        return _FLIGHTS.setdefault(key, threading.Lock())


def _fetch_or_plan(sock: socket.socket, spec: UnplannedShard) -> ExpectedShard:
    table = _shipped_table(sock, spec)
    if table is None:
        return spec.plan()
    try:
        claim = content.sample_claim(spec.raw.files, coverage=table.share)
    except OSError as exc:
        raise CheckpointError(f"{spec.raw.path}: cannot read: {exc}") from None
    key = spec.key
    fingerprint = {"checkpoint": key["checkpoint"], "tp_size": key["tp_size"],
                   "tp_rank": key["tp_rank"], "dtype": table.served_dtype,
                   "shard_rules": key["shard_rules"], "aliases": fp.aliases_hash(table.aliases),
                   "runtime_version": key["runtime_version"]}
    PLANS.put(spec.cache_key, plancache.Plan(
        tuple(spec.raw.files), spec.dirs, plancache.claimed_identities(claim), table,
        fingerprint, table.share), spec.started_ns)
    return ExpectedShard(table, {**fingerprint, "content": claim}, spec.identity, spec.device)


def _from_cache(
    spec: ExpectedShard | UnplannedShard, path: Path, **kw: Any
) -> tuple[ExpectedShard, dict[str, torch.Tensor], int, int | None]:
    """The cache path; whatever a daemon (or a lying peer) answers, a WeightCacheError."""
    try:
        return _from_cache_unchecked(spec, path, **kw)
    except WeightCacheError:
        raise
    except Exception as exc:  # the contract: never another exception from the cache path
        raise CacheProtocolError(f"unusable reply: {type(exc).__name__}: {exc}") from None


def _check_table(plan: ExpectedShard, reply: dict[str, Any]) -> None:
    """The daemon's table must be exactly the layout we computed from the checkpoint
    ourselves: anything else is a partial or foreign shard, never served. The daemon sends
    the digest of its table (`ArenaLayout.digest`), compared with our own plan's."""
    if reply.get("table_digest") != plan.layout.digest:
        raise CacheProtocolError("the daemon's tensor table differs from this checkpoint's layout")


def _check_unchanged_after_copy(
    sock: socket.socket, since: float, path: Path, generation: Any, *,
    connect_timeout_s: float, state_timeout_s: float, meanwhile: Callable[[], None],
    claim: dict[str, Any] | None = None,
) -> None:
    """`_check_unchanged`, asked on the attach's own connection while the daemon surely keeps
    it (its idle deadline is REQUEST_DEADLINE_S) and on a fresh one otherwise: a long copy
    may outlast the deadline, and a connection dropped anyway is asked again anew.

    The copy has landed before this is called, so the answer is about a moment after it:
    `meanwhile()` (the unmapping) runs while the daemon answers. With the content `claim` of
    a copy asked for with the claim after (`check_claim`), the same answer is also the
    claim's verdict: a refused claim raises FingerprintMismatchError, and the copy is never
    used."""
    cmd, fields = ("check_claim", {"claim": claim}) if claim is not None else ("hello", {})
    answer = None
    sent = False
    if time.monotonic() - since < REQUEST_DEADLINE_S / 2:
        with contextlib.suppress(DaemonUnavailableError, CacheProtocolError):
            send_request(sock, cmd, **fields)
            sent = True
    meanwhile()
    if sent:
        with contextlib.suppress(DaemonUnavailableError, CacheProtocolError):
            answer, _ = recv_reply(sock, cmd)
    if answer is None:
        with contextlib.closing(connect(path, timeout=connect_timeout_s)) as again:
            again.settimeout(state_timeout_s)
            answer, _ = request(again, cmd, **fields)
    _check_generation(answer, generation)


def _check_unchanged(sock: socket.socket, generation: Any) -> None:
    """After a copy: no update wrote the arena while we copied it (`_check_generation`)."""
    hello, _ = request(sock, "hello")
    _check_generation(hello, generation)


def _check_generation(hello: dict[str, Any], generation: Any) -> None:
    """After a copy: no update wrote the arena while we copied it.

    Copy-mode engines are not paused by an in-place update (they own their bytes once the
    copy is done), so a copy that overlapped an update's write would hold two revisions at
    once. The daemon's `hello` reports the update phase and generation: the copy is whole
    only if the generation is still the one `get_state` served and no write is under way."""
    raise_for(hello)
    update = hello.get("update")
    if update is None:
        return  # a daemon without in-place updates never rewrites its arena
    if (not isinstance(update, dict) or update.get("generation") != generation
            or update.get("phase") not in ("idle", "staged")):
        raise CacheProtocolError(
            "the cache was updated while this engine copied it (generation "
            f"{generation!r} -> {update.get('generation') if isinstance(update, dict) else '?'})")


class _Hello:
    """A connection to the daemon with its `hello` sent before this engine plans.

    The daemon answers while the plan is made (a kept plan: 0.5 ms of file stats and the
    content claim's start), so the attach no longer waits a round trip after it: the `hello`
    phase was 0.35-0.40 ms of a copy-mode attach on the H200 (runs 35-36). Nothing here
    decides anything: an error is kept and raised where the cache path would have connected
    (`take`), so it falls back to disk the same way; a plan that took long enough for the
    daemon's idle deadline to near gets a fresh connection instead."""

    def __init__(self, path: Path | None, timeout: float) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.error: WeightCacheError | None = None
        self.at = time.monotonic()
        if path is None:
            return
        try:
            self.sock = connect(path, timeout=timeout)
            send_request(self.sock, "hello")
        except WeightCacheError as exc:
            self.close()
            self.error = exc

    def take(self, path: Path) -> socket.socket | None:
        """The connection, for `path` only and once; None: connect anew."""
        sock, self.sock = self.sock, None
        error, self.error = self.error, None
        if path != self.path:
            if sock is not None:
                sock.close()
            return None
        if error is not None:
            raise error
        if sock is not None and time.monotonic() - self.at > REQUEST_DEADLINE_S / 2:
            sock.close()  # the daemon may drop it before our next request arrives
            return None
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _early_path(socket_path: str | os.PathLike | None, socket_dir: Any, device: torch.device,
                device_index: int, role: str) -> Path | None:
    """Where the cache path will connect, if that can be said before the plan (else None:
    it is found, and any error reported, after the plan as before)."""
    if socket_path is not None:
        return Path(socket_path)
    try:
        return derive_socket_path(resolve_socket_dir(socket_dir),
                                  device_identity(device.type, device_index), role)
    except Exception:
        return None


class _Clock:
    """Seconds per phase of one attach (AttachResult.phases)."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


class _Allocator:
    """The one thread of this process that does copy mode's driver work off the attach's path:
    it allocates destination blocks on CUDA, and unmaps an arena once its copy has landed.

    A fresh 16 GB block takes milliseconds of driver calls (16.4-16.6 ms on the H200), which
    run on this thread while the request and the mapping go on. A thread started per attach
    cost the attach its start: 0.52-0.60 ms of `sent` against 0.12 ms into the caller's block
    (`out=`, no thread; H200, runs 35-36), about 0.4 ms of an 11-12 ms copy. This thread is
    started once, when a copy-mode attach begins (`warm`, before its plan), and then waits on
    its queue; handing it work costs a queue's `put`. A forked child starts its own.

    The unmap after the copy (`release_later`) was 0.3-0.5 ms on the attach's path, after the
    copy and before the answer it waits for (H200, run51); nothing the engine holds views the
    mapping by then, so it can end here. The release makes the device's context current itself
    (`_cuda.DeviceMemory`), so any thread may run it. Host mappings (memfd) end here too: one
    path on every device, the one CI runs.
    """

    _guard = threading.Lock()
    _queue: queue.SimpleQueue[Callable[[], None]] | None = None
    _pid = 0

    @classmethod
    def warm(cls) -> queue.SimpleQueue[Callable[[], None]]:
        with cls._guard:
            if cls._queue is None or cls._pid != os.getpid():
                cls._queue, cls._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=cls._serve, args=(cls._queue,),
                                 name="weightcache-alloc", daemon=True).start()
            return cls._queue

    @staticmethod
    def _serve(work: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            work.get()()

    @classmethod
    def release_later(cls, imported: Any) -> None:
        """Close a mapping whose copy has landed, on this thread."""

        def release() -> None:
            try:
                imported.close()
            except Exception:  # nothing waits for it: said, never raised into the thread
                log.exception("weightcache: unmapping a copied arena failed")

        cls.warm().put(release)

    @classmethod
    def settle(cls, timeout: float | None = None) -> bool:
        """Wait until the work handed to this thread so far is done (the tests use it)."""
        done = threading.Event()
        cls.warm().put(done.set)
        return done.wait(timeout)


class _Destination:
    """Copy mode's destination: the caller's block, or on CUDA one the allocating thread
    (`_Allocator`) makes while the request and the mapping go on."""

    def __init__(self, nbytes: int, device: torch.device, out: torch.Tensor | None) -> None:
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.block: torch.Tensor | None = None
        self.done: threading.Event | None = None
        if out is not None:
            if (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes
                    or out.device != device or not out.is_contiguous()):
                raise ValueError(f"out must be a contiguous flat uint8 tensor of >= {nbytes}"
                                 f" bytes on {device}")
            self.block = out
            return
        if device.type != "cuda":
            # Host memory comes from mmap untouched (microseconds): handing it to a thread
            # would cost more than it hides (0.3-0.5 ms of `sent` on a 2-core VM).
            self.block = torch.empty(nbytes, dtype=torch.uint8)
            return
        # The caller's stream: the caching allocator ties a block to the stream it was
        # allocated on, and the engine uses (and one day frees) it on its own.
        self._request = (nbytes, device, torch.cuda.current_stream(device))
        self.done = threading.Event()
        _Allocator.warm().put(self.allocate)

    def allocate(self) -> None:
        """On the allocating thread."""
        assert self.done is not None
        nbytes, device, stream = self._request
        try:
            with torch.cuda.stream(stream):
                self.block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except BaseException as exc:  # re-raised by take()
            self.error = exc
        finally:
            self.done.set()

    def take(self) -> torch.Tensor:
        if self.done is not None:
            self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.block is not None
        return self.block

    @classmethod
    def guess(cls, key: tuple[Any, ...], device: torch.device) -> _Destination | None:
        """A fresh block of the size of the plan this process keeps for `key`, allocated
        from now on, before the plan is checked: the allocation (1.4 ms for 16 GB on the H200,
        longer beside the map) is what a copy into fresh memory waits for, and it no longer
        starts only after the plan. None without a kept plan. The plan decides: a block of
        another size is given back before one of the right size is asked for (`fits`)."""
        kept = PLANS.peek(key)
        return None if kept is None else cls(kept.layout.nbytes, device, None)

    def fits(self, nbytes: int) -> bool:
        """Whether this block is the size the checked plan needs; if not, it is dropped
        once allocated, so that the right one is not asked for beside it."""
        if self.nbytes == nbytes:
            return True
        self.drop()
        return False

    def drop(self) -> None:
        """Give the block back (once allocated) while this object may still be referenced:
        a disk load must not find the cache path's block still held."""
        if self.done is not None:
            self.done.wait()
        self.block = None


def _from_cache_unchecked(
    spec: ExpectedShard | UnplannedShard, path: Path, *, mode: str, tp_size: int, tp_rank: int,
    connect_timeout_s: float, state_timeout_s: float, phases: dict[str, float] | None = None,
    out: torch.Tensor | None = None, early: _Hello | None = None,
    guess: _Destination | None = None,
) -> tuple[ExpectedShard, dict[str, torch.Tensor], int, int | None]:
    """(the plan served by, the named tensors, the arena's size, the generation); `early`:
    a connection whose `hello` went out before the plan; `guess`: copy mode's block, asked
    for before the plan by the size of the one kept (`_Destination.guess`)."""
    clock = _Clock({} if phases is None else phases)
    destination: _Destination | None = None

    def copy_to(nbytes: int) -> None:
        nonlocal destination
        if mode == "copy" and destination is None:
            destination = (guess if guess is not None and guess.fits(nbytes)
                           else _Destination(nbytes, spec.device, out))

    if isinstance(spec, ExpectedShard):
        # Known already: allocate while we ask. (Started after the requests instead, the
        # sends took 0.33 ms instead of 0.77 on the H200, but the map 1.85 instead of 1.05,
        # and copy mode was no faster: two runs on two machines, docs/performance.md.)
        copy_to(spec.layout.nbytes)
    # Copy mode with a kept plan asks for the state right behind the hello, without waiting
    # for its answer (the daemon reads one request at a time, so the second waits in the
    # socket), and without its content claim: the claim's chunks hash while the arena is
    # mapped and copied, and the claim goes with the after-copy check (`check_claim`, protocol
    # 4). On the H200 the claim's hashing (1.6-2.2 ms) had been the bound in front of a 7 ms
    # copy. The copy is used only if the daemon accepts the claim. If the hello refuses us,
    # the connection closes with the state's reply unread (its fds with it), and a copy holds
    # nothing: the daemon counts it as no blocker of updates. A zero_copy attach keeps the
    # two apart and claims first, since it serves from the daemon's arena itself and the
    # daemon counts a zero_copy export as an engine to pause.
    pipelined = mode == "copy" and isinstance(spec, ExpectedShard)
    sock = early.take(path) if early is not None else None
    if sock is None:
        sock = connect(path, timeout=connect_timeout_s)
        try:
            send_request(sock, "hello")
        except BaseException:
            sock.close()
            raise
    with contextlib.closing(sock):
        if pipelined:
            assert isinstance(spec, ExpectedShard)
            send_request(sock, "get_state", fingerprint=spec.unclaimed(), mode=mode,
                         claim="after")
            clock.mark("sent")  # both requests sent; the claim still hashing
        hello, _ = recv_reply(sock, "hello")
        raise_for(hello)
        if hello.get("protocol") != proto.PROTOCOL_VERSION:
            raise CacheProtocolError(f"daemon speaks protocol {hello.get('protocol')!r}")
        if not hello.get("ready"):
            raise NotReadyError(f"daemon at {path} holds no weights (loading or released)")
        served = (hello.get("device") or {}).get("uuid")
        if served != spec.identity:
            raise DeviceMismatchError(f"daemon serves device {served!r}, we are {spec.identity!r}")
        if hello.get("rank") != tp_rank or hello.get("tp_size") != tp_size:
            raise FingerprintMismatchError(
                f"daemon serves rank {hello.get('rank')}/{hello.get('tp_size')},"
                f" we are {tp_rank}/{tp_size}",
                [f for f, a, b in (("tp_rank", hello.get("rank"), tp_rank),
                                   ("tp_size", hello.get("tp_size"), tp_size)) if a != b],
            )
        clock.mark("hello")
        sock.settimeout(state_timeout_s)
        if isinstance(spec, UnplannedShard):
            plan = _plan_here_or_shipped(sock, spec)
            clock.mark("get_plan")
            copy_to(plan.layout.nbytes)
        else:
            plan = spec
        if pipelined:
            reply, fds = recv_reply(sock, "get_state", accept_fds=True)
        else:
            reply, fds = request(sock, "get_state", accept_fds=True,
                                 fingerprint=plan.claimed(), mode=mode)
        served_at = time.monotonic()
        clock.mark("get_state")
        try:
            raise_for(reply)
            _check_table(plan, reply)
            meta = reply.get("arena")
            if not isinstance(meta, dict) or not isinstance(meta.get("transport"), str):
                raise CacheProtocolError("get_state reply has no arena")
            nbytes = meta.get("nbytes")
            if isinstance(nbytes, int) and nbytes < plan.layout.nbytes:
                raise CacheProtocolError(
                    f"arena of {nbytes} bytes cannot hold the {plan.layout.nbytes}-byte layout")
            transport = get_transport(meta["transport"])
            owned, fds = fds, []  # attach() owns (and closes) them from here, even on failure
            imported = transport.attach(meta, owned, plan.device)
        except TransportError as exc:
            raise CacheProtocolError(f"cannot map the arena: {exc}") from None
        finally:
            for fd in fds:
                os.close(fd)
        try:
            copy_into = (getattr(imported, "copy_into", None) if destination is not None
                         else None)
            if copy_into is not None:
                assert destination is not None
                # The transport maps the arena a piece at a time and queues each piece's copy
                # into the block allocated meanwhile as soon as that piece is mapped, so the
                # copy runs beside the rest of the map (cuda_vmm with pieces).
                flat = copy_into(destination.take, plan.layout.nbytes)
                clock.mark("map")
            else:
                flat = imported.tensor()
                clock.mark("map")
                if flat.numel() < plan.layout.nbytes:
                    raise CacheProtocolError(
                        f"mapped arena holds {flat.numel()} bytes, the layout needs"
                        f" {plan.layout.nbytes}")
                if destination is not None:
                    # One copy of the laid-out bytes into the block allocated meanwhile,
                    # queued on the device; the mapping stays until the views are built, so
                    # that work overlaps the copy (unmapping waits for it).
                    block = destination.take()
                    clock.mark("alloc")
                    need = plan.layout.nbytes
                    block[:need].copy_(flat[:need], non_blocking=True)
                    flat = block
                    clock.mark("copy_queued")
            # Our own layout, or the daemon's bound to our files; equal to the served one
            # (its digest). Its rows are checked against the arena as the views are made.
            state = plan.layout.views(flat)
            clock.mark("views")
        except (ArenaLayoutError, plantable.PlanTableError) as exc:
            imported.close()
            raise CacheProtocolError(f"bad tensor table: {exc}") from None
        except TransportError as exc:  # a mapping made when first used
            imported.close()
            raise CacheProtocolError(f"cannot map the arena: {exc}") from None
        except BaseException:
            imported.close()
            raise
        generation = reply.get("generation")
        if mode == "copy":
            try:
                # Hashed while the copy runs, and asked for before waiting on it: the claim's
                # last chunks and this call's 0.2 ms (H200, run51) no longer follow the copy.
                claim = plan.claimed()["content"] if pipelined else None
            except BaseException:
                # The copy may still be running from this mapping: every CUDA transport's
                # close synchronizes the device before it unmaps (cuda_vmm, cuda_ipc).
                imported.close()
                raise
            clock.mark("claimed")
            if plan.device.type == "cuda":
                torch.cuda.synchronize(plan.device)  # the copy has landed
            clock.mark("copy")

            def release() -> None:
                _Allocator.release_later(imported)  # the unmap, off the attach's path
                clock.mark("release")

            _check_unchanged_after_copy(sock, served_at, path, generation, meanwhile=release,
                                        connect_timeout_s=connect_timeout_s,
                                        state_timeout_s=state_timeout_s, claim=claim)
            clock.mark("check")
        # Copy mode no longer releases the cache: one engine's copy must not empty it for
        # every later engine on the GPU (release is the agent's decision, docs/native.md).
        return plan, state, flat.numel(), generation if isinstance(generation, int) else None


def load_from_disk(layout: ArenaLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """The same shard and layout as the daemon's, read from the checkpoint files."""
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    load_into_arena(layout, flat)  # on CUDA: the staged, multi-threaded loader
    return layout.views(flat)


def attach(
    model_dir: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    socket_dir: str | os.PathLike | None = None,
    socket_path: str | os.PathLike | None = None,
    mode: str | None = None,
    fallback: bool | None = None,
    connect_timeout_s: float | None = None,
    state_timeout_s: float | None = None,
    shard_rules: list[str] | None = None,
    dtype: str = "auto",
    role: str = ROLE_TARGET,
    device_index: int | None = None,
    out: torch.Tensor | None = None,
) -> AttachResult:
    """Like `load_state_dict`, but also says where the tensors came from and how long it took.

    `out` (copy mode): a flat uint8 block on the device, at least the shard's size, to copy
    into instead of a fresh allocation (an engine reloading into the memory it has)."""
    started = time.perf_counter()
    device = torch.device(device)
    mode = _pick(mode, os.environ.get(constants.ENV_MODE) or None, "zero_copy")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fallback = _pick(fallback, _env_bool(constants.ENV_FALLBACK), True)
    connect_timeout_s = _pick(connect_timeout_s, _env_float(constants.ENV_CONNECT_TIMEOUT), 5.0)
    state_timeout_s = _pick(state_timeout_s, _env_float(constants.ENV_STATE_TIMEOUT), 300.0)
    socket_dir = _pick(socket_dir, os.environ.get(constants.ENV_SOCKET_DIR) or None, None)
    if device_index is None:
        if device.type == "cuda":
            device_index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            device_index = tp_rank
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", device_index)
    guess = None
    if mode == "copy" and out is None:
        _Allocator.warm()  # its thread starts beside the plan, not on the attach's path
        # Bad arguments were never planned, so no plan is kept for them: no guess either.
        guess = _Destination.guess(_plan_key(model_dir, tp_size, tp_rank, shard_rules, dtype),
                                   device)
    early = _Hello(_early_path(socket_path, socket_dir, device, device_index, role),
                   connect_timeout_s)
    try:
        return _attach(model_dir, early, started=started, device=device, tp_size=tp_size,
                       tp_rank=tp_rank, socket_dir=socket_dir, socket_path=socket_path,
                       mode=mode, fallback=fallback, connect_timeout_s=connect_timeout_s,
                       state_timeout_s=state_timeout_s, shard_rules=shard_rules, dtype=dtype,
                       role=role, device_index=device_index, out=out, guess=guess)
    finally:
        early.close()  # unused (a plan that failed, a path found otherwise)


def _attach(
    model_dir: str | os.PathLike, early: _Hello, *, started: float, device: torch.device,
    tp_size: int, tp_rank: int, socket_dir: Any, socket_path: str | os.PathLike | None,
    mode: str, fallback: bool, connect_timeout_s: float, state_timeout_s: float,
    shard_rules: list[str] | None, dtype: str, role: str, device_index: int,
    out: torch.Tensor | None, guess: _Destination | None,
) -> AttachResult:
    """`attach` once its arguments are settled and the daemon's `hello` is on its way."""
    # Bad checkpoints and rules are configuration errors: the disk path could not do better.
    phases: dict[str, float] = {}
    t_plan = time.perf_counter()
    with gc_paused():  # the plan and the views: many objects, no cyclic garbage (gcpause.py)
        spec = expect_rank(
            model_dir, device=device, device_index=device_index, tp_size=tp_size,
            tp_rank=tp_rank, shard_rules=shard_rules, dtype=dtype,
        )
    phases["plan"] = time.perf_counter() - t_plan
    plan: ExpectedShard | None = spec if isinstance(spec, ExpectedShard) else None
    # Found before the plan (`_early_path`: the same socket_path, or directory and identity);
    # resolved again here only to raise its error where it could not be.
    path: Path | None = early.path
    try:
        if path is None:
            try:
                directory = resolve_socket_dir(socket_dir)
            except FileNotFoundError as exc:
                raise DaemonUnavailableError(f"no socket directory {exc.filename}") from None
            except SecurityError as exc:
                raise CacheSecurityError(str(exc)) from None
            path = derive_socket_path(directory, spec.identity, role)
        cache_kw = dict(mode=mode, tp_size=tp_size, tp_rank=tp_rank, out=out, phases=phases,
                        guess=guess,
                        connect_timeout_s=connect_timeout_s, state_timeout_s=state_timeout_s)
        try:
            with gc_paused():
                plan, state, nbytes, generation = _from_cache(spec, path, early=early,
                                                              **cache_kw)
        except DaemonLoadingError:
            # Scale-up: the daemon is still loading this rank; it will finish before a disk
            # read beside it would (engine/loading.py). Only past the bound: disk.
            bound, waited = wait_while_loading(path, wait_bound())
            if not bound:
                raise
            log.info("weightcache: waited %.2f s for the daemon loading %s", waited, path)
            with gc_paused():
                plan, state, nbytes, generation = _from_cache(spec, path, **cache_kw)
        source, reason = "cache", None
    except CheckpointError:
        raise  # the checkpoint itself is bad (found planning after the daemon's answer)
    except WeightCacheError as exc:
        generation = None
        if not fallback:
            raise
        reason = f"{exc.reason}: {exc}"
    if reason is not None:
        # From disk, outside the handler: the failed cache path's frames went with its
        # traceback, and with them a copy's destination block, which a disk load beside it
        # would have doubled on the device. A block allocated ahead (`guess`) is dropped too.
        if guess is not None:
            guess.drop()
        cache = os.environ.get(constants.ENV_CACHE)
        log.warning(
            "weightcache%s: loading %s (rank %d/%d) from disk: %s",
            f" {cache}" if cache else "", model_dir, tp_rank, tp_size, reason,
        )
        if plan is None or not isinstance(plan.layout, ArenaLayout):
            with gc_paused():  # the disk path reads by this engine's own plan
                plan = spec.plan() if isinstance(spec, UnplannedShard) else plan_rank(
                    model_dir, device=device, device_index=device_index, tp_size=tp_size,
                    tp_rank=tp_rank, shard_rules=shard_rules, dtype=dtype, cache=False)
        assert isinstance(plan.layout, ArenaLayout)
        try:
            state = load_from_disk(plan.layout, device)
        except Exception as disk:  # one contract: a failed load is a WeightCacheError
            raise DiskFallbackError(
                f"cannot load {model_dir} (rank {tp_rank}/{tp_size}) from the cache ({reason})"
                f" nor from disk: {type(disk).__name__}: {disk}", reason,
            ) from disk
        nbytes, source = plan.layout.nbytes, "disk"
    return AttachResult(
        state_dict=state,
        source=source,
        reason=reason,
        seconds=time.perf_counter() - started,
        nbytes=nbytes,
        tensors=plan.tensors,
        mode=mode,
        socket=str(path) if path else None,
        aliases=dict(plan.layout.aliases),
        generation=generation,
        phases={k: round(v, 6) for k, v in phases.items()},
        plan=plan.how,
    )


def load_state_dict(
    model_dir: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
    tp_rank: int = 0,
    socket_dir: str | os.PathLike | None = None,
    mode: str | None = None,
    fallback: bool | None = None,
    connect_timeout_s: float | None = None,
    state_timeout_s: float | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """This rank's tensors by name; tied names map to the same tensor object.

    Unset arguments come from WEIGHTCACHE_* environment variables, then the defaults
    (zero_copy, fallback on, 5 s connect, 300 s state). `options`: socket_path, shard_rules,
    dtype, role, device_index (see `attach`).
    """
    return attach(
        model_dir, device=device, tp_size=tp_size, tp_rank=tp_rank, socket_dir=socket_dir,
        mode=mode, fallback=fallback, connect_timeout_s=connect_timeout_s,
        state_timeout_s=state_timeout_s, **options,
    ).state_dict


# -- module materialisation -----------------------------------------------------------------
def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), attr


def non_persistent_buffers(module: nn.Module) -> list[str]:
    """Names of the buffers registered with `persistent=False` (no checkpoint holds them)."""
    names = []
    for name, _ in module.named_buffers(remove_duplicate=False):
        owner, attr = _owner(module, name)
        if attr in owner._non_persistent_buffers_set:
            names.append(name)
    return names


def materialize(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    requires_grad: bool = False,
    ignore_unexpected: tuple[str, ...] = (),
    device: torch.device | str | None = None,
) -> nn.Module:
    """Replace the (meta) parameters and buffers of `module` with tensors of `state_dict`.

    Parameters that are one object in the module (tied) stay one object, and names the state
    dict maps to the same tensor (aliases) become one Parameter. No copy is made.

    Non-persistent buffers (rotary `inv_freq` and the like) are in no checkpoint: one the state
    dict lacks keeps its value and moves to `device` (default: the state dict's device); one
    still on the meta device has no value anywhere, which is an error in strict mode (build
    the module with real buffers, or use `weightcache.client.from_pretrained` for a
    transformers model). Strict mode also refuses state-dict tensors the module has no place
    for (`UnexpectedTensorError`), except names matching a regex in `ignore_unexpected` and
    aliases of a tensor that was used.
    """
    if device is None:
        first = next(iter(state_dict.values()), None)
        device = first.device if first is not None else None
    target = torch.device(device) if device is not None else None
    # Names per parameter object, so a tied group finds its tensor under any of its names.
    groups: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        params[id(param)] = param
    by_tensor: dict[int, nn.Parameter] = {}
    used: set[int] = set()
    missing: list[str] = []
    for key, names in groups.items():
        found = next((n for n in names if n in state_dict), None)
        if found is None:
            missing.extend(names)
            continue
        tensor, param = state_dict[found], params[key]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{found}: state dict has shape {list(tensor.shape)}, module {list(param.shape)}"
            )
        new = by_tensor.get(id(tensor)) or nn.Parameter(tensor, requires_grad=requires_grad)
        by_tensor[id(tensor)] = new
        used.add(id(tensor))
        for name in names:
            owner, attr = _owner(module, name)
            owner._parameters[attr] = new
    volatile = set(non_persistent_buffers(module))
    for name, buf in list(module.named_buffers(remove_duplicate=False)):
        owner, attr = _owner(module, name)
        tensor = state_dict.get(name)
        if tensor is not None:
            owner._buffers[attr] = tensor
            used.add(id(tensor))
        elif buf is None:
            continue
        elif buf.device.type == "meta":
            missing.append(name)
        elif name in volatile and target is not None and buf.device != target:
            owner._buffers[attr] = buf.to(target)
    if missing and strict:
        hint = ""
        if any(n in volatile for n in missing):
            hint = (" (non-persistent buffers are in no checkpoint: build the module with real"
                    " buffers, or use weightcache.client.from_pretrained for transformers)")
        raise MissingTensorError(f"state dict lacks {len(missing)} tensors: {missing[:8]}{hint}")
    if strict:
        patterns = [re.compile(p) for p in ignore_unexpected]
        unexpected = [
            n for n, t in state_dict.items()
            if id(t) not in used and not any(p.search(n) for p in patterns)
        ]
        if unexpected:
            raise UnexpectedTensorError(
                f"the module has no place for {len(unexpected)} tensors of the state dict:"
                f" {unexpected[:8]} (a checkpoint for another architecture or size?)"
            )
    return module


__all__ = [
    "AttachResult",
    "CacheProtocolError",
    "CacheSecurityError",
    "CheckpointError",
    "DaemonError",
    "DaemonLoadingError",
    "DaemonUnavailableError",
    "DeviceMismatchError",
    "DiskFallbackError",
    "FingerprintMismatchError",
    "MissingTensorError",
    "NotReadyError",
    "ReleasedError",
    "ShardingError",
    "UnexpectedTensorError",
    "WeightCacheError",
    "attach",
    "connect",
    "load_from_disk",
    "load_state_dict",
    "materialize",
    "non_persistent_buffers",
    "query",
    "request",
]
