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
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightcache import constants
from weightcache.contracts.vocabulary import MODES, ROLE_TARGET
from weightcache.errors import ProjectError

from ..shared import coldload, content
from ..shared import protocol as proto
from ..shared.checkpoint import CheckpointError, open_checkpoint
from ..shared.connection import connect, query, raise_for, request
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
    """What this engine expects its rank's daemon to serve, computed from the checkpoint
    itself: the layout and fingerprint it will compare the daemon's answer with, and the
    device identity whose socket it asks (not `shared.rankplan`, which plans the shard)."""

    layout: ArenaLayout
    fingerprint: dict[str, Any]
    identity: str
    device: torch.device
    planned: bool = True  # False: the plan came from this process' cache (plancache.py)


# Plans of this process, reused while no file they were made from changed (plancache.py).
PLANS = plancache.PlanCache()


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
    """What this rank expects: its layout and fingerprint, with a fresh content claim.

    With `cache`, a plan made earlier in this process from the very same files is reused
    (plancache.py says when); the claim is sampled anew either way."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tp_rank {tp_rank} for tp_size {tp_size}")
    identity = device_identity(device.type, device_index)
    path = Path(model_dir)
    key = (os.path.abspath(path), tp_size, tp_rank,
           None if shard_rules is None else tuple(shard_rules), dtype)
    started = plancache.now_ns()
    dirs = plancache.directory_stamps(path)
    kept = PLANS.get(key, dirs) if cache else None
    if kept is not None:
        try:
            claim = content.sample_claim(kept.files, coverage=kept.share)
        except OSError:
            claim = None  # a file went away: plan again, which says what is wrong
        if claim is not None and plancache.claimed_identities(claim) == kept.identities:
            return ExpectedShard(kept.layout, {**kept.fingerprint, "content": claim}, identity,
                                 device, planned=False)
        PLANS.drop(key)
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


def _from_cache(
    plan: ExpectedShard, path: Path, **kw: Any
) -> tuple[dict[str, torch.Tensor], int, int | None]:
    """The cache path; whatever a daemon (or a lying peer) answers, a WeightCacheError."""
    try:
        return _from_cache_unchecked(plan, path, **kw)
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
    connect_timeout_s: float, state_timeout_s: float,
) -> None:
    """`_check_unchanged`, asked on the attach's own connection while the daemon surely keeps
    it (its idle deadline is REQUEST_DEADLINE_S) and on a fresh one otherwise: a long copy
    may outlast the deadline, and a connection dropped anyway is asked again anew."""
    hello = None
    if time.monotonic() - since < REQUEST_DEADLINE_S / 2:
        with contextlib.suppress(DaemonUnavailableError, CacheProtocolError):
            hello, _ = request(sock, "hello")
    if hello is None:
        with contextlib.closing(connect(path, timeout=connect_timeout_s)) as again:
            again.settimeout(state_timeout_s)
            hello, _ = request(again, "hello")
    _check_generation(hello, generation)


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


def _from_cache_unchecked(
    plan: ExpectedShard, path: Path, *, mode: str, tp_size: int, tp_rank: int,
    connect_timeout_s: float, state_timeout_s: float,
) -> tuple[dict[str, torch.Tensor], int, int | None]:
    with contextlib.closing(connect(path, timeout=connect_timeout_s)) as sock:
        hello, _ = request(sock, "hello")
        raise_for(hello)
        if hello.get("protocol") != proto.PROTOCOL_VERSION:
            raise CacheProtocolError(f"daemon speaks protocol {hello.get('protocol')!r}")
        if not hello.get("ready"):
            raise NotReadyError(f"daemon at {path} holds no weights (loading or released)")
        served = (hello.get("device") or {}).get("uuid")
        if served != plan.identity:
            raise DeviceMismatchError(f"daemon serves device {served!r}, we are {plan.identity!r}")
        if hello.get("rank") != tp_rank or hello.get("tp_size") != tp_size:
            raise FingerprintMismatchError(
                f"daemon serves rank {hello.get('rank')}/{hello.get('tp_size')},"
                f" we are {tp_rank}/{tp_size}",
                [f for f, a, b in (("tp_rank", hello.get("rank"), tp_rank),
                                   ("tp_size", hello.get("tp_size"), tp_size)) if a != b],
            )
        sock.settimeout(state_timeout_s)
        reply, fds = request(sock, "get_state", accept_fds=True, fingerprint=plan.fingerprint,
                             mode=mode)
        served_at = time.monotonic()
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
            flat = imported.tensor()
            if flat.numel() < plan.layout.nbytes:
                raise CacheProtocolError(
                    f"mapped arena holds {flat.numel()} bytes, the layout needs"
                    f" {plan.layout.nbytes}")
            if mode == "copy":
                # One copy of the whole arena, queued on the device; the mapping stays until
                # the views are built, so that work overlaps the copy (unmapping waits for it).
                flat = flat.clone()
            # Our own layout, now known equal to the daemon's (its digest).
            state = plan.layout.views(flat)
        except ArenaLayoutError as exc:
            imported.close()
            raise CacheProtocolError(f"bad tensor table: {exc}") from None
        except BaseException:
            imported.close()
            raise
        generation = reply.get("generation")
        if mode == "copy":
            imported.close()
            if plan.device.type == "cuda":
                torch.cuda.synchronize(plan.device)  # the clone has landed
            _check_unchanged_after_copy(sock, served_at, path, generation,
                                        connect_timeout_s=connect_timeout_s,
                                        state_timeout_s=state_timeout_s)
        # Copy mode no longer releases the cache: one engine's copy must not empty it for
        # every later engine on the GPU (release is the agent's decision, docs/native.md).
        return state, flat.numel(), generation if isinstance(generation, int) else None


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
) -> AttachResult:
    """Like `load_state_dict`, but also says where the tensors came from and how long it took."""
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
    # Bad checkpoints and rules are configuration errors: the disk path could not do better.
    with gc_paused():  # the plan and the views: many objects, no cyclic garbage (gcpause.py)
        plan = plan_rank(
            model_dir, device=device, device_index=device_index, tp_size=tp_size,
            tp_rank=tp_rank, shard_rules=shard_rules, dtype=dtype,
        )
    path: Path | None = None
    try:
        if socket_path is not None:
            path = Path(socket_path)
        else:
            try:
                directory = resolve_socket_dir(socket_dir)
            except FileNotFoundError as exc:
                raise DaemonUnavailableError(f"no socket directory {exc.filename}") from None
            except SecurityError as exc:
                raise CacheSecurityError(str(exc)) from None
            path = derive_socket_path(directory, plan.identity, role)
        cache_kw = dict(mode=mode, tp_size=tp_size, tp_rank=tp_rank,
                        connect_timeout_s=connect_timeout_s, state_timeout_s=state_timeout_s)
        try:
            with gc_paused():
                state, nbytes, generation = _from_cache(plan, path, **cache_kw)
        except DaemonLoadingError:
            # Scale-up: the daemon is still loading this rank; it will finish before a disk
            # read beside it would (engine/loading.py). Only past the bound: disk.
            bound, waited = wait_while_loading(path, wait_bound())
            if not bound:
                raise
            log.info("weightcache: waited %.2f s for the daemon loading %s", waited, path)
            with gc_paused():
                state, nbytes, generation = _from_cache(plan, path, **cache_kw)
        source, reason = "cache", None
    except WeightCacheError as exc:
        generation = None
        if not fallback:
            raise
        reason = f"{exc.reason}: {exc}"
        cache = os.environ.get(constants.ENV_CACHE)
        log.warning(
            "weightcache%s: loading %s (rank %d/%d) from disk: %s",
            f" {cache}" if cache else "", model_dir, tp_rank, tp_size, reason,
        )
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
        tensors=len(plan.layout.entries),
        mode=mode,
        socket=str(path) if path else None,
        aliases=dict(plan.layout.aliases),
        generation=generation,
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
