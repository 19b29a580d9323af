"""One daemon rank: load this rank's shard into one arena, then serve it on a Unix socket.

Started by `weightcache preload` (one process per rank) as
`python -m weightcache.native.daemon ...`. Order matters: take the socket's lock, remove a stale
socket, load the whole shard, and only then bind, so a client either finds no socket (and
falls back) or a daemon with a complete table. The launcher learns that the rank serves from
one `SERVING {json}` line on stdout.

Exit codes: 0 clean stop, 2 bad input (model, shard rules, flags), 3 another daemon holds the
socket, 4 socket directory refused by the security checks, 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.contracts.vocabulary import (
    DTYPES,
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_SECURITY,
    ROLE_ALIASES,
    ROLE_TARGET,
    ROLES,
    canonical_role,
)

from ..shared import content as content_mod
from ..shared import fingerprint as fp
from ..shared import limits
from ..shared import protocol as proto
from ..shared.checkpoint import CheckpointError, open_checkpoint
from ..shared.identity import device_identity, socket_path
from ..shared.security import (
    AlreadyRunningError,
    SecurityError,
    SocketLock,
    bind_unix_socket,
    check_peer,
    check_socket_slot,
    peer_credentials,
    prepare_socket_dir,
)
from ..shared.sharding import ShardingError, parse_rules
from .lifetime import request_parent_death_signal
from .prefetch import Prefetcher
from .progress import Counter, Ticker

if TYPE_CHECKING:  # torch is imported only once this rank holds its socket's lock
    import torch

    from ..shared.loader import ArenaLayout
    from ..shared.transport import Arena
    from .updater import RankUpdater

log = logging.getLogger("weightcache.daemon")

IDLE_TIMEOUT_S = limits.REQUEST_DEADLINE_S  # a request must arrive whole within this
MAX_CONNECTIONS = limits.MAX_CONNECTIONS
MAX_REQUEST = 1 << 20  # requests are small maps; a content claim is a few KiB
ACCEPT_WAKE_S = 0.25  # how often the accept loop lets a pending signal handler run
# Attach-duration histogram bounds (seconds), Prometheus-style cumulative buckets.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Test hook: hold the shard loaded but unbound for this long, to observe the loading window.
BIND_DELAY_ENV = "WEIGHTCACHE_DEBUG_BIND_DELAY_S"
# Warm the page cache with the checkpoint while torch and CUDA start (prefetch.py); 1 = on.
# Off by default: on the H200 VM with every cache dropped it competed with the imports' own
# reads and made READY 1.1 s later (docs/performance.md).
PREFETCH_ENV = "WEIGHTCACHE_LOAD_PREFETCH"
LOADING_INTERVAL_S = 0.5  # how often a loading rank reports its bytes on stdout


class Stop(BaseException):
    """Raised by the signal handler while a rank loads, to abandon the load.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (logging's
    own error handling among them) can swallow it. Once the rank serves, the handler no longer
    raises: it sets the server's stop flag and wakes the accept loop instead (`_Serving`).
    """


class _Serving:
    """The server and listener of this process once it serves, for the signal handler.

    `abandon` is true while a signal may abandon the load by raising `Stop`; the handler
    clears it before raising, so a second signal (the launcher's SIGTERM after a Ctrl-C that
    reached the whole process group) can never raise again inside the cleanup.
    """

    server: RankServer | None = None
    listener: socket.socket | None = None
    abandon: bool = True


class Stats:
    """Counters the node agent scrapes with the `stats` command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, dict[str, int]] = {}
        self.mismatches: dict[str, int] = {}
        self.buckets = [0] * len(BUCKETS)
        self.attach_count = 0
        self.attach_sum = 0.0
        self.watchers = 0
        self.connections = 0

    def request(self, command: str, result: str) -> None:
        with self._lock:
            per = self.requests.setdefault(command, {})
            per[result] = per.get(result, 0) + 1

    def mismatch(self, fields: list[str]) -> None:
        with self._lock:
            for name in fields:
                if name in fp.FIELDS:  # a fixed set: never a key a client chose
                    self.mismatches[name] = self.mismatches.get(name, 0) + 1

    def attach(self, seconds: float) -> None:
        with self._lock:
            self.attach_count += 1
            self.attach_sum += seconds
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    self.buckets[i] += 1

    def adjust(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": {k: dict(v) for k, v in self.requests.items()},
                "mismatches": dict(self.mismatches),
                "attach_seconds": {
                    "buckets": [[b, c] for b, c in zip(BUCKETS, self.buckets, strict=True)]
                    + [["+Inf", self.attach_count]],
                    "sum": self.attach_sum,
                    "count": self.attach_count,
                },
                "watchers": self.watchers,
                "connections": self.connections,
            }


class RankServer:
    def __init__(
        self,
        *,
        arena: Arena,
        transport_name: str,
        layout: ArenaLayout,
        fingerprint: dict[str, Any],
        identity: str,
        device: torch.device,
        rank: int,
        tp_size: int,
        role: str,
        global_rank: int,
        dp_rank: int,
        load_seconds: float,
        allowed_uids: set[int],
        content: dict[str, content_mod.FileDigest] | None = None,
    ) -> None:
        self.arena: Arena | None = arena
        self.transport_name = transport_name
        self.table = layout.table()
        self.aliases = layout.aliases
        self.nbytes = layout.nbytes
        self.fingerprint = fingerprint
        self.identity = identity
        self.device = device
        self.rank = rank
        self.tp_size = tp_size
        self.global_rank = global_rank
        self.dp_rank = dp_rank
        self.role = role
        self.load_seconds = load_seconds
        self.allowed_uids = allowed_uids
        self.content = content or {}
        self.stats = Stats()
        self._state_lock = threading.Lock()
        self._watchers: set[socket.socket] = set()
        self._slots = limits.PeerLimiter(MAX_CONNECTIONS, limits.PER_PID, limits.PER_UID,
                                         own_uid=os.getuid())
        self._watch_slots = limits.PeerLimiter(limits.MAX_WATCHERS, limits.WATCH_PER_PID)
        # get_state replies that handed out the arena to a zero_copy engine: after `release`
        # those engines may still map it, so its memory is not known to be freed.
        self.zero_copy_attaches = 0
        self.released_bytes = 0
        self.stopping = threading.Event()
        self.updates: RankUpdater | None = None  # set by run(): in-place updates

    # -- commands ---------------------------------------------------------------------------
    def _device_info(self) -> dict[str, Any]:
        return {"kind": self.device.type, "uuid": self.identity, "index": self.device.index or 0}

    def cmd_hello(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        from ..shared.transport import available_transports

        return proto.ok(
            protocol=proto.PROTOCOL_VERSION,
            runtime_version=fp.RUNTIME_VERSION,
            capabilities=available_transports(self.device),
            transport=self.transport_name,
            device=self._device_info(),
            rank=self.rank,
            tp_size=self.tp_size,
            global_rank=self.global_rank,
            dp_rank=self.dp_rank,
            role=self.role,
            ready=self.arena is not None,
            pid=os.getpid(),
            content=self.fingerprint.get("content"),
            **({"update": self.updates.info()} if self.updates else {}),
        ), []

    def cmd_get_memory(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        held = self.arena is not None
        return proto.ok(
            bytes=self.nbytes if held else 0,
            tensors=len(self.table) if held else 0,
            device=self._device_info(),
            released=not held,
            # After release: bytes engines that attached zero_copy may still map (an upper
            # bound; the kernel frees the pages when the last of them unmaps).
            mapped_after_release=self.released_bytes if not held else 0,
        ), []

    def cmd_stats(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return proto.ok(
            **self.stats.snapshot(),
            rank=self.rank,
            global_rank=self.global_rank,
            dp_rank=self.dp_rank,
            bytes=self.nbytes if self.arena is not None else 0,
            load_seconds=self.load_seconds,
            ready=self.arena is not None,
            **({"updates": self.updates.snapshot()} if self.updates else {}),
        ), []

    def cmd_get_state(
        self, req: dict[str, Any], pid: int = 0
    ) -> tuple[dict[str, Any], list[int]]:
        expected = req.get("fingerprint")
        problem = fp.validate(expected)
        if problem:
            return proto.error(proto.E_BAD_REQUEST, f"get_state: {problem}"), []
        wanted = req.get("transport")
        mode = req.get("mode", "zero_copy")
        if mode not in ("zero_copy", "copy"):
            return proto.error(proto.E_BAD_REQUEST, "get_state: mode must be zero_copy or copy"), []
        if wanted is not None and not isinstance(wanted, str):
            return proto.error(proto.E_BAD_REQUEST, "get_state: transport must be a string"), []
        if wanted is not None and wanted != self.transport_name:
            return proto.error(
                proto.E_TRANSPORT_UNAVAILABLE,
                f"this rank serves transport {self.transport_name!r}, not {wanted!r}",
                available=[self.transport_name],
            ), []
        if self.updates is None:
            return self._state_reply(expected, mode, 1)
        return self.updates.attach(
            pid, mode, lambda generation: self._state_reply(expected, mode, generation))

    def _state_reply(
        self, expected: dict[str, Any], mode: str, generation: int
    ) -> tuple[dict[str, Any], list[int]]:
        """Identity check, then the table and the arena's fds (under the updater's lock)."""
        fields = fp.mismatched_fields(self.fingerprint, expected, self.content)
        if fields:
            self.stats.mismatch(fields)
            why = ""
            if "content" in fields:
                why = f" ({content_mod.verify_claim(self.content, expected.get('content'))})"
            return proto.error(
                proto.E_FINGERPRINT_MISMATCH,
                f"cached shard differs in: {', '.join(fields)}{why}",
                fields=fields,
            ), []
        with self._state_lock:
            if self.arena is None:
                return proto.error(proto.E_RELEASED, "the cache was released"), []
            meta, fds = self.arena.export()
            # Duplicates: a concurrent `release` may close the arena's own fds before we send.
            reply = proto.ok(tensors=self.table, aliases=self.aliases, arena=meta,
                             generation=generation)
            if mode == "zero_copy":
                self.zero_copy_attaches += 1
            return reply, [os.dup(fd) for fd in fds]

    def cmd_release(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Drop the daemon's arena: later engines fall back. Memory engines map stays theirs.

        The reply says what was actually freed: `released` is the daemon's reference
        (bytes); `still_mapped` is how much engines that attached zero_copy may keep mapped
        (all of it when any did: the daemon cannot see their mappings end), so `freed` is
        true only when no zero_copy engine ever attached.
        """
        with self._state_lock:
            if self.arena is None:
                return proto.ok(released=0, still_mapped=self.released_bytes, freed=False), []
            if self.transport_name == "cuda_ipc" and self.zero_copy_attaches:
                # Legacy CUDA IPC: memory an exporter frees is gone for its importers too
                # (undefined behaviour per the CUDA docs), so never free it under engines.
                return proto.error(
                    proto.E_BUSY,
                    f"{self.zero_copy_attaches} zero_copy engine(s) may map this cuda_ipc arena;"
                    " releasing it would free memory under them (stop them first)",
                ), []
            arena, self.arena = self.arena, None
            mapped = self.nbytes if self.zero_copy_attaches else 0
            self.released_bytes = mapped
        # Freeing a large arena takes a while; the client need not wait for it.
        threading.Thread(target=arena.close, daemon=True).start()
        log.info("rank %d released its arena (%d bytes; %d may stay mapped by %d zero_copy "
                 "attach(es))", self.rank, self.nbytes, mapped, self.zero_copy_attaches)
        return proto.ok(released=self.nbytes, still_mapped=mapped, freed=mapped == 0), []

    # -- connections ------------------------------------------------------------------------
    def handle(self, conn: socket.socket, peer: tuple[int, int, int]) -> None:
        started = time.monotonic()
        served_state = False
        pool = self._slots
        self.stats.adjust("connections", 1)
        try:
            try:
                check_peer(conn, self.allowed_uids)
            except SecurityError as exc:
                self.stats.request("connect", proto.E_PERMISSION_DENIED)
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    proto.send_frame(conn, proto.error(proto.E_PERMISSION_DENIED, str(exc)))
                return
            while not self.stopping.is_set():
                # One deadline for the whole request, however slowly its bytes come.
                deadline = time.monotonic() + IDLE_TIMEOUT_S
                if self.updates is not None and self.updates.owns(conn):
                    # A coordinator holding a staged update waits on the other ranks (or
                    # nodes) between phases; its own close aborts the update.
                    deadline = time.monotonic() + self.updates.HOLD_S
                try:
                    req, fds_in = proto.recv_frame(conn, max_frame=MAX_REQUEST, deadline=deadline,
                                                   accept_fds=True)
                except proto.PeerClosedError:
                    return
                except proto.ProtocolError as exc:
                    self.stats.request("invalid", exc.code)
                    with contextlib.suppress(OSError, proto.ProtocolError):
                        proto.send_frame(conn, proto.error(exc.code, str(exc)))
                    return
                cmd = req.get("cmd")
                if not isinstance(cmd, str) or len(cmd) > limits.MAX_COMMAND_LENGTH:
                    self.stats.request("invalid", proto.E_BAD_REQUEST)
                    proto.send_frame(conn, proto.error(
                        proto.E_BAD_REQUEST, "cmd must be a short string"))
                    continue
                conn.settimeout(IDLE_TIMEOUT_S)  # the reply must be taken in time, too
                if fds_in and cmd not in proto.FD_COMMANDS:
                    for fd in fds_in:
                        os.close(fd)
                    self.stats.request("invalid", proto.E_BAD_FRAME)
                    proto.send_frame(conn, proto.error(proto.E_BAD_FRAME,
                                                       f"{cmd!r} does not take fds"))
                    return
                if cmd in proto.UPDATE_COMMANDS and self.updates is not None:
                    if peer[1] != os.getuid() and cmd != "get_table":
                        # Engines of other uids may read the cache, never rewrite it.
                        for fd in fds_in:
                            os.close(fd)
                        self.stats.request(cmd, proto.E_PERMISSION_DENIED)
                        proto.send_frame(conn, proto.error(
                            proto.E_PERMISSION_DENIED, f"{cmd} is reserved to uid {os.getuid()}"))
                        continue
                    try:
                        reply = self.updates.handle(conn, cmd, req, fds_in)
                    except Exception as exc:  # a bug must not take the rank down
                        log.exception("command %s failed", cmd)
                        reply = proto.error(proto.E_INTERNAL, f"{type(exc).__name__}: {exc}")
                    self.stats.request(cmd, "ok" if reply.get("ok") else reply.get("error", "?"))
                    proto.send_frame(conn, reply)
                    continue
                if cmd == "watch" and isinstance(req.get("participant"), dict) and self.updates:
                    # An engine's update stream: a watcher (watch pool) that also answers.
                    why = self._watch_slots.acquire(peer[0], peer[1])
                    if why:
                        self.stats.request("watch", proto.E_BUSY)
                        proto.send_frame(conn, proto.error(proto.E_BUSY, f"watch: {why}"))
                        return
                    self._slots.release(peer[0], peer[1])
                    pool = self._watch_slots
                    self.stats.request("watch", "ok")
                    self.stats.adjust("watchers", 1)
                    self._watchers.add(conn)
                    try:
                        self.updates.participate(conn, peer[0], req["participant"])
                    finally:
                        self._watchers.discard(conn)
                        self.stats.adjust("watchers", -1)
                    return
                if cmd == "watch":
                    if self._watch(conn, peer):
                        self._slots.release(peer[0], peer[1])  # a watcher holds no attach slot
                        pool = self._watch_slots
                        self._hold_watch(conn)
                    return  # refused (`busy` sent) or done watching: the connection closes
                handler = getattr(self, f"cmd_{cmd}", None) if cmd in proto.COMMANDS else None
                if handler is None:
                    self.stats.request("unknown", proto.E_UNKNOWN_COMMAND)
                    proto.send_frame(
                        conn, proto.error(proto.E_UNKNOWN_COMMAND, f"unknown command {cmd!r}")
                    )
                    continue
                try:
                    reply, fds = (handler(req, peer[0]) if cmd == "get_state"
                                  else handler(req))
                except Exception as exc:  # a bug must not take the rank down
                    log.exception("command %s failed", cmd)
                    reply, fds = proto.error(proto.E_INTERNAL, f"{type(exc).__name__}: {exc}"), []
                self.stats.request(cmd, "ok" if reply.get("ok") else reply.get("error", "error"))
                try:
                    proto.send_frame(conn, reply, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                if cmd == "get_state" and reply.get("ok"):
                    served_state = True
        except (OSError, proto.ProtocolError):
            return
        except Exception:  # never let one connection's surprise kill silently
            log.exception("connection handler failed")
            with contextlib.suppress(OSError, proto.ProtocolError):
                proto.send_frame(conn, proto.error(proto.E_INTERNAL, "internal error"))
        finally:
            if self.updates is not None:
                self.updates.connection_closed(conn)
            with contextlib.suppress(OSError):
                conn.close()
            if served_state:
                self.stats.attach(time.monotonic() - started)
            self.stats.adjust("connections", -1)
            pool.release(peer[0], peer[1])

    def _watch(self, conn: socket.socket, peer: tuple[int, int, int]) -> bool:
        """Move the connection to the watch pool; False (and `busy` sent) when it is full."""
        why = self._watch_slots.acquire(peer[0], peer[1])
        if why:
            self.stats.request("watch", proto.E_BUSY)
            proto.send_frame(conn, proto.error(proto.E_BUSY, f"watch: {why}"))
            return False
        self.stats.request("watch", "ok")
        try:
            proto.send_frame(conn, proto.ok(watching=True, rank=self.rank))
        except BaseException:
            self._watch_slots.release(peer[0], peer[1])
            raise
        return True

    def _hold_watch(self, conn: socket.socket) -> None:
        """Hold the connection open until the peer leaves or the daemon stops."""
        conn.settimeout(None)
        self._watchers.add(conn)
        self.stats.adjust("watchers", 1)
        try:
            while not self.stopping.is_set():
                if not conn.recv(4096):
                    return
        except OSError:
            return
        finally:
            self._watchers.discard(conn)
            self.stats.adjust("watchers", -1)

    def serve(self, listener: socket.socket) -> None:
        # A process-directed signal may be delivered to any of torch's threads; then the main
        # thread's accept() is not interrupted and Python's handler would wait for it forever.
        # Waking up now and then lets the handler run (it then shuts the listener down).
        listener.settimeout(ACCEPT_WAKE_S)
        while not self.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                raise
            try:
                peer = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            why = self._slots.acquire(peer[0], peer[1])
            if why:
                self.stats.request("connect", proto.E_BUSY)
                with contextlib.suppress(OSError, proto.ProtocolError):
                    conn.settimeout(0.5)
                    proto.send_frame(conn, proto.error(proto.E_BUSY, why))
                conn.close()
                continue
            try:
                threading.Thread(target=self.handle, args=(conn, peer), daemon=True).start()
            except RuntimeError:  # cannot start a thread: refuse rather than die
                self._slots.release(peer[0], peer[1])
                conn.close()

    def shutdown(self) -> None:
        self.stopping.set()
        for conn in list(self._watchers):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._state_lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None


def _digest_into(files: list[Path], out: dict[str, Any]) -> None:
    try:
        out["files"] = content_mod.digest_files(files)
    except content_mod.ContentError as exc:
        out["error"] = str(exc)


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when the launcher dies, so ranks never outlive it."""
    if parent_pid is not None and not request_parent_death_signal(parent_pid):
        raise Stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache-daemon", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (the shard)")
    # Where this rank sits in the whole group; reported, not fingerprinted: a dense model's
    # data-parallel replicas hold identical shards.
    p.add_argument("--global-rank", type=int, default=None)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--device-index", type=int, default=None)
    p.add_argument("--weight-cache-socket-dir", default=None)
    p.add_argument("--shard-rule", action="append", default=None)
    p.add_argument("--no-shard-rules", action="store_true")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--role", choices=(*ROLES, *ROLE_ALIASES), default=ROLE_TARGET)
    p.add_argument("--transport", default=None)
    p.add_argument("--allow-uid", type=int, action="append", default=[])
    p.add_argument("--parent-pid", type=int, default=None)
    return p


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Check input, take the lock, then (and only then) import torch, load, bind, serve.

    Taking the lock before importing torch makes a second daemon for the same device fail
    in a fraction of a second.
    """
    started = time.monotonic()
    tp, rank = args.tensor_parallel_size, args.rank
    if tp < 1 or not 0 <= rank < tp:
        log.error("bad rank %d for tensor-parallel-size %d", rank, tp)
        return EXIT_BAD_INPUT
    index = rank if args.device_index is None else args.device_index
    global_rank = rank if args.global_rank is None else args.global_rank
    if index < 0 or global_rank < 0 or args.dp_rank < 0:
        log.error("bad device index %d / global rank %d / dp rank %d",
                  index, global_rank, args.dp_rank)
        return EXIT_BAD_INPUT
    try:
        rules = parse_rules([] if args.no_shard_rules else args.shard_rule)
        ckpt = open_checkpoint(args.model)
    except (CheckpointError, ShardingError) as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    try:
        sock_dir = prepare_socket_dir(args.weight_cache_socket_dir)
    except (SecurityError, OSError) as exc:
        log.error("socket directory refused: %s", exc)
        return EXIT_SECURITY
    identity = device_identity(args.device, index)
    args.role = canonical_role(args.role)
    path = socket_path(sock_dir, identity, args.role)
    lock = SocketLock(path)
    try:
        lock.acquire()
    except AlreadyRunningError as exc:
        log.error("%s", exc)
        return EXIT_LOCKED
    except SecurityError as exc:
        log.error("cannot lock %s: %s", lock.path, exc)
        return EXIT_SECURITY
    except OSError as exc:  # ENOSPC, EIO...: not a security verdict
        log.error("cannot lock %s: %s", lock.path, exc)
        return EXIT_ERROR
    try:
        check_socket_slot(path)
    except (SecurityError, OSError) as exc:
        log.error("%s", exc)
        lock.release()
        return EXIT_SECURITY
    arena: Arena | None = None
    listener: socket.socket | None = None
    server: RankServer | None = None
    phases: dict[str, float] = {}
    mark = started
    prefetcher = None
    if os.environ.get(PREFETCH_ENV, "0").strip().lower() in {"1", "true", "yes", "on"}:
        prefetcher = Prefetcher(ckpt.files).start()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 4)
        mark = now

    try:
        import torch

        from ..shared.loader import load_into_arena
        from ..shared.rankplan import plan_rank_shard
        from ..shared.transport import default_transport, get_transport

        device = torch.device(args.device, index) if args.device == "cuda" else torch.device("cpu")
        phase("startup_seconds")  # headers, device identity (imports torch on CUDA), lock
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.empty(0, device=device)  # the CUDA context, timed on its own
        phase("cuda_init_seconds")
        try:
            layout, fingerprint = plan_rank_shard(ckpt, rules, tp_size=tp, tp_rank=rank,
                                                  dtype=args.dtype)
        except ShardingError as exc:
            log.error("%s", exc)
            return EXIT_BAD_INPUT
        try:  # a table msgpack cannot carry would make a READY rank that never serves
            proto.encode(proto.ok(tensors=layout.table(), aliases=layout.aliases))
        except (proto.ProtocolError, OverflowError, ValueError) as exc:
            log.error("%s: the tensor table cannot be served: %s", args.model, exc)
            return EXIT_BAD_INPUT
        # A socket left by a dead daemon would let clients connect to nothing: drop it first.
        if os.path.lexists(path):
            with contextlib.suppress(FileNotFoundError):
                if Path(path).is_socket() and not Path(path).is_symlink():
                    os.unlink(path)
        phase("plan_seconds")
        t0 = time.monotonic()
        transport = get_transport(args.transport) if args.transport else default_transport(device)
        arena = transport.allocate(layout.nbytes, device)
        # Every byte's digest, computed beside the load (hashlib releases the GIL).
        digests: dict[str, Any] = {}
        digest_thread = threading.Thread(
            target=_digest_into, args=(ckpt.files, digests), name="digest", daemon=True)
        digest_thread.start()
        phase("allocate_seconds")
        prefetched = prefetcher.stop() if prefetcher is not None else None
        done = Counter()
        t_load = time.monotonic()

        def report() -> None:
            _emit("LOADING " + json.dumps({
                "rank": global_rank, "bytes_loaded": done.value, "bytes": layout.nbytes,
                "seconds": round(time.monotonic() - t_load, 3)}))

        ticker = Ticker(report, LOADING_INTERVAL_S).start()
        try:
            # The digest thread reads the same files through the page cache at the same time.
            # O_DIRECT reads would bypass it, so the disk would deliver every byte twice (seen on
            # an H200: fill 8.8 s, then 8.9 s more for the digest); buffered reads let the two
            # readers share one pass. An explicit WEIGHTCACHE_LOAD_DIRECT still wins.
            direct = None if os.environ.get("WEIGHTCACHE_LOAD_DIRECT") else False
            loaded = load_into_arena(layout, arena.tensor(), progress=done.add, direct=direct)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            ticker.stop()
        done.add(layout.nbytes - done.value)  # the alignment padding between tensors
        report()
        phase("fill_seconds")
        digest_thread.join()
        phase("digest_wait_seconds")  # how long the digest outlasted the fill
        if "error" in digests:
            log.error("rank %d: %s", rank, digests["error"])
            return EXIT_ERROR
        record = digests["files"]
        fingerprint = {**fingerprint, "content": content_mod.content_root(record)}
        load_seconds = time.monotonic() - t0
        delay = float(os.environ.get(BIND_DELAY_ENV, "0") or 0)
        if delay > 0:
            time.sleep(delay)
        arena.export()  # seal / create the handle now, not on the first engine's clock
        phase("export_seconds")
        server = RankServer(
            arena=arena,
            transport_name=transport.name,
            layout=layout,
            fingerprint=fingerprint,
            identity=identity,
            device=device,
            rank=rank,
            tp_size=tp,
            role=args.role,
            global_rank=global_rank,
            dp_rank=args.dp_rank,
            load_seconds=load_seconds,
            allowed_uids={os.getuid(), *args.allow_uid},
            content=record,
        )
        from .updater import RankUpdater, UpdateConfig

        server.updates = RankUpdater(server, UpdateConfig(
            rules=rules, tp_size=tp, tp_rank=rank, dtype=args.dtype, model=str(args.model)))
        try:
            listener = bind_unix_socket(path, limits.LISTEN_BACKLOG,
                                        shared=bool(args.allow_uid))
        except SecurityError as exc:
            log.error("%s", exc)
            return EXIT_SECURITY
        _emit(
            "SERVING "
            + json.dumps(
                {
                    "rank": rank,
                    "global_rank": global_rank,
                    "dp_rank": args.dp_rank,
                    "local_rank": index,
                    "socket": str(path),
                    "device": identity,
                    "bytes": layout.nbytes,
                    "tensors": len(layout.entries),
                    "load_seconds": round(load_seconds, 4),
                    "load_gb_per_s": float(f"{layout.nbytes / load_seconds / 1e9:.4g}")
                    if load_seconds > 0 else None,
                    "phases": phases,
                    "prefetch": prefetched,
                    "loader": loaded.as_dict() if loaded is not None else None,
                    "pid": os.getpid(),
                    "content": fingerprint["content"],
                }
            )
        )
        log.info("rank %d serving %d bytes on %s", rank, layout.nbytes, path)
        _Serving.server, _Serving.listener = server, listener
        server.serve(listener)
        return EXIT_OK
    except Stop:
        return EXIT_OK
    except Exception as exc:  # report any failure as this rank's exit code, never hang
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        return EXIT_ERROR
    finally:
        # From here on signals must not interrupt: the cleanup is what they ask for.
        _Serving.abandon = False
        _ignore_stop_signals()
        if prefetcher is not None:
            prefetcher.stop()
        _Serving.server = _Serving.listener = None
        if server is not None:
            server.shutdown()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if arena is not None:
            arena.close()
        lock.release()


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _on_signal(signum: int, frame: Any) -> None:
    server, listener = _Serving.server, _Serving.listener
    if server is None or listener is None:
        if _Serving.abandon:
            _Serving.abandon = False
            raise Stop()
        return
    server.stopping.set()
    # accept() is retried after the handler returns (PEP 475); a shut-down listener makes it
    # fail at once, and serve() sees the stop flag.
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{args.rank if args.global_rank is None else args.global_rank}"
        " %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        _die_with_parent(args.parent_pid)
        return run(args)
    except Stop:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
