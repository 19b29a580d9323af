"""One daemon rank's server: the commands of the socket protocol over its loaded arena.

`rank.py` builds it once the shard is loaded and binds the socket; each connection then runs
on its own thread through `RankServer.handle`: admit the peer, read a whole request within the
deadline, answer it (a command, an update phase for `updater.py`, or a watch that moves to the
watch pool), and on close free the connection's slot. Imported only after the rank holds its
socket's lock (it imports torch through the transports).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..shared import coldload, limits, plantable, rankplan
from ..shared import content as content_mod
from ..shared import fingerprint as fp
from ..shared import protocol as proto
from ..shared.checkpoint import Checkpoint
from ..shared.identity import device_identity
from ..shared.loader import ArenaLayout
from ..shared.security import SecurityError, check_peer, peer_credentials
from ..shared.sharding import ShardRule
from ..shared.transport import Arena, available_transports
from .config import RankConfig
from .handlers import Acceptors
from .histogram import Histogram
from .loading import LoadedShard
from .updater import RankUpdater, UpdateConfig

log = logging.getLogger("weightcache.daemon")

IDLE_TIMEOUT_S = limits.REQUEST_DEADLINE_S  # a request must arrive whole within this
MAX_CONNECTIONS = limits.MAX_CONNECTIONS
MAX_REQUEST = 1 << 20  # requests are small maps; a content claim is a few KiB
PLAN_WAIT_S = 30.0  # the longest a `get_plan` waits for the plan's encoding at start
ACCEPT_WAKE_S = 0.25  # how often the accept loop lets a pending signal handler run
# Attach-duration histogram bounds (seconds), Prometheus-style cumulative buckets.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Connection:
    """One client connection: its peer `(pid, uid, gid)`, the pool whose slot it holds (the
    attach pool, or the watch pool once it watches) and whether it received a tensor table."""

    conn: socket.socket
    peer: tuple[int, int, int]
    pool: limits.PeerLimiter
    started: float = field(default_factory=time.monotonic)
    served_state: bool = False
    claim_owed: bool = False  # a `get_state {claim: "after"}` served, no `check_claim` yet


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Stats:
    """Counters the node agent scrapes with the `stats` command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, dict[str, int]] = {}
        self.mismatches: dict[str, int] = {}
        self.attach_seconds = Histogram(BUCKETS)
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
            self.attach_seconds.observe(seconds)

    def adjust(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": {k: dict(v) for k, v in self.requests.items()},
                "mismatches": dict(self.mismatches),
                "attach_seconds": self.attach_seconds.snapshot(),
                "watchers": self.watchers,
                "connections": self.connections,
            }


class RankServer:
    """One rank's loaded arena, served to engines on its socket (each connection on the
    thread that accepted it: handlers.py)."""

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
        self.table = layout.table()  # the rows, for `get_table` (updates and tools)
        self.table_digest = layout.digest  # what `get_state` sends instead of the rows
        self.aliases = layout.aliases
        self.nbytes = layout.nbytes
        # The shipped plan (plantable.py): its key and encoded table (`ship_plan`), and the
        # source tags that say which dtype another engine's request would be served in.
        self.plan_key: dict[str, Any] | None = None
        self.plan_blob: bytes | None = None
        self.plan_digest: str | None = None
        self._plan_built = threading.Event()
        self._plan_built.set()  # until ship_plan: no plan to wait for
        self.tags = frozenset(e.source.tag for e in layout.entries)
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
        self.updates: RankUpdater | None = None  # set once built: in-place updates
        self._transports: list[str] | None = None
        self._acceptors: Acceptors | None = None

    def ship_plan(self, build: Any) -> None:
        """Encode the plan on a thread of its own (about 2 us per tensor, so not in front of
        READY); a `get_plan` meanwhile waits for it, at most PLAN_WAIT_S."""
        self._plan_built.clear()

        def run() -> None:
            try:
                built = build()
                if built is not None:
                    self.plan_key, self.plan_blob = built
                    self.plan_digest = plantable.digest(built[1])
            except Exception:  # engines then plan themselves
                log.exception("cannot encode the plan; engines will plan themselves")
            finally:
                self._plan_built.set()

        threading.Thread(target=run, name="weightcache-plan", daemon=True).start()

    # -- commands ---------------------------------------------------------------------------
    def _device_info(self) -> dict[str, Any]:
        return {"kind": self.device.type, "uuid": self.identity, "index": self.device.index or 0}

    def _capabilities(self) -> list[str]:
        """The transports that serve this device: asked once (every attach says hello)."""
        if self._transports is None:
            self._transports = available_transports(self.device)
        return list(self._transports)

    def cmd_hello(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return proto.ok(
            protocol=proto.PROTOCOL_VERSION,
            runtime_version=fp.RUNTIME_VERSION,
            capabilities=self._capabilities(),
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
            **self._update_info(),
        ), []

    def _update_info(self) -> dict[str, Any]:
        """What `hello` and `check_claim` say of updates: an engine compares the two."""
        return {"update": self.updates.info()} if self.updates else {}

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

    def cmd_get_plan(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """This rank's plan (plantable.py) in chunks, to an engine whose key is ours.

        Nothing of the arena goes with it: `get_state` still checks the whole fingerprint
        and the content claim. A mismatch is an ordinary answer (the engine then plans
        itself, as a config.json of its own makes it), so it is not counted as one."""
        key, dtype, offset = req.get("key"), req.get("dtype"), req.get("offset", 0)
        problem = plantable.key_problem(key)
        short = isinstance(dtype, str) and len(dtype) <= plantable.MAX_DTYPE_TEXT
        if problem is None and not short:
            problem = "dtype must be a short string"
        if problem is None and (not isinstance(offset, int) or isinstance(offset, bool)
                                or offset < 0):
            problem = "offset must be a non-negative integer"
        if problem:
            return proto.error(proto.E_BAD_REQUEST, f"get_plan: {problem}"), []
        self._plan_built.wait(PLAN_WAIT_S)
        own, blob = self.plan_key, self.plan_blob
        if own is None or blob is None or own["checkpoint"] != self.fingerprint.get("checkpoint"):
            # No table (not encodable), or an update served other headers since.
            return proto.error(proto.E_NO_PLAN, "this rank ships no plan: plan it yourself"), []
        fields = plantable.mismatched(own, key)
        if rankplan.served_for(self.tags, dtype) != self.fingerprint.get("dtype"):
            fields.append("dtype")
        if fields:
            return proto.error(proto.E_FINGERPRINT_MISMATCH,
                               f"the plan was made from other input: {', '.join(fields)}",
                               fields=fields), []
        return proto.ok(size=len(blob), digest=self.plan_digest, offset=offset,
                        data=blob[offset:offset + plantable.CHUNK]), []

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
        later = req.get("claim")
        if later not in (None, "after"):
            return proto.error(proto.E_BAD_REQUEST, "get_state: claim must be \"after\""), []
        if later and (mode != "copy" or "content" in expected):
            # zero_copy: the engine serves from our arena itself, so its claim comes first.
            return proto.error(proto.E_BAD_REQUEST, "get_state: a claim after the state is for"
                               " copy mode only, with no content in the fingerprint"), []
        if wanted is not None and not isinstance(wanted, str):
            return proto.error(proto.E_BAD_REQUEST, "get_state: transport must be a string"), []
        if wanted is not None and wanted != self.transport_name:
            return proto.error(
                proto.E_TRANSPORT_UNAVAILABLE,
                f"this rank serves transport {self.transport_name!r}, not {wanted!r}",
                available=[self.transport_name],
            ), []
        if self.updates is None:
            return self._state_reply(expected, mode, 1, bool(later))
        return self.updates.attach(
            pid, mode, lambda generation: self._state_reply(expected, mode, generation,
                                                            bool(later)))

    def _state_reply(
        self, expected: dict[str, Any], mode: str, generation: int, claim_later: bool = False
    ) -> tuple[dict[str, Any], list[int]]:
        """Identity check, then the table and the arena's fds (under the updater's lock)."""
        fields = fp.mismatched_fields(self.fingerprint, expected, self.content,
                                      claim_later=claim_later)
        if fields:
            self.stats.mismatch(list(fields))
            return proto.error(
                proto.E_FINGERPRINT_MISMATCH,
                f"cached shard differs in: {fp.describe(fields)}",
                fields=list(fields),
            ), []
        with self._state_lock:
            if self.arena is None:
                return proto.error(proto.E_RELEASED, "the cache was released"), []
            meta, fds = self.arena.export()
            # Duplicates: a concurrent `release` may close the arena's own fds before we send.
            # The table's digest, not its rows: the engine compares it with its own plan's
            # (the rows were 11 MB of msgpack at 100,000 tensors, encoded on every attach).
            reply = proto.ok(table_digest=self.table_digest, arena=meta, generation=generation)
            if mode == "zero_copy":
                self.zero_copy_attaches += 1
            return reply, [os.dup(fd) for fd in fds]

    def cmd_check_claim(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """(protocol 4) A copy-mode engine's content claim, sent once its copy has landed.

        After `get_state {claim: "after"}` the engine holds bytes it may not use yet: it uses
        them only if this answers ok, and otherwise drops them and loads from disk, exactly as
        if `get_state` had refused its claim (the mismatch is counted the same way). The
        content claim proves which bytes the engine's own files hold, never who may read the
        arena (the socket's permissions and peer checks decide that). The reply carries the
        update state, as `hello` does, so it is also the check that no update wrote the arena
        while the engine copied it."""
        why = content_mod.verify_claim(self.content, req.get("claim"))
        if why is not None:
            self.stats.mismatch(["content"])
            return proto.error(proto.E_FINGERPRINT_MISMATCH,
                               f"cached shard differs in: {fp.describe({'content': why})}",
                               fields=["content"]), []
        return proto.ok(ready=self.arena is not None, **self._update_info()), []

    def cmd_release(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Drop the daemon's arena: later engines fall back. Memory engines map stays theirs.

        The reply says what was actually freed: `released` is the daemon's reference
        (bytes); `still_mapped` is how much engines that attached zero_copy may keep mapped
        (all of it when any did: the daemon cannot see their mappings end), so `freed` is
        true only when no zero_copy engine ever attached. Refused while an update writes.
        """
        if self.updates is None:
            return self._release()
        return self.updates.release(self._release)

    def _release(self) -> tuple[dict[str, Any], list[int]]:
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
        """Serve one connection: admit the peer, then answer its requests until it leaves."""
        c = Connection(conn, peer, self._slots)
        self.stats.adjust("connections", 1)
        try:
            if not self._admit(c):
                return
            while not self.stopping.is_set():
                request = self._next_request(c)
                if request is None or not self._answer(c, *request):
                    return
        except (OSError, proto.ProtocolError):
            return
        except Exception:  # never let one connection's surprise kill silently
            log.exception("connection handler failed")
            with contextlib.suppress(OSError, proto.ProtocolError):
                proto.send_frame(conn, proto.error(proto.E_INTERNAL, "internal error"))
        finally:
            self._close(c)

    def _admit(self, c: Connection) -> bool:
        """The peer's uid must be allowed (`permission_denied` sent otherwise)."""
        try:
            check_peer(c.conn, self.allowed_uids)
        except SecurityError as exc:
            self.stats.request("connect", proto.E_PERMISSION_DENIED)
            with contextlib.suppress(OSError):
                c.conn.settimeout(1.0)
                proto.send_frame(c.conn, proto.error(proto.E_PERMISSION_DENIED, str(exc)))
            return False
        return True

    def _next_request(self, c: Connection) -> tuple[dict[str, Any], list[int]] | None:
        """The next whole request and its fds; None when the connection ends.

        One deadline for the whole request, however slowly its bytes come. A coordinator
        holding a staged update waits on the other ranks (or nodes) between phases (its own
        close aborts the update), so its connection may idle longer."""
        hold = self.updates is not None and self.updates.owns(c.conn)
        deadline = time.monotonic() + (self.updates.HOLD_S if hold else IDLE_TIMEOUT_S)
        try:
            return proto.recv_frame(c.conn, max_frame=MAX_REQUEST, deadline=deadline,
                                    accept_fds=True)
        except proto.PeerClosedError:
            return None
        except proto.ProtocolError as exc:
            self.stats.request("invalid", exc.code)
            with contextlib.suppress(OSError, proto.ProtocolError):
                proto.send_frame(c.conn, proto.error(exc.code, str(exc)))
            return None

    def _answer(self, c: Connection, req: dict[str, Any], fds: list[int]) -> bool:
        """Answer one request; False when the connection is done (watch ended, bad frame)."""
        cmd = req.get("cmd")
        if not isinstance(cmd, str) or len(cmd) > limits.MAX_COMMAND_LENGTH:
            _close_fds(fds)
            self.stats.request("invalid", proto.E_BAD_REQUEST)
            proto.send_frame(c.conn, proto.error(proto.E_BAD_REQUEST, "cmd must be a short string"))
            return True
        c.conn.settimeout(IDLE_TIMEOUT_S)  # the reply must be taken in time, too
        if fds and cmd not in proto.FD_COMMANDS:
            _close_fds(fds)
            self.stats.request("invalid", proto.E_BAD_FRAME)
            proto.send_frame(c.conn, proto.error(proto.E_BAD_FRAME, f"{cmd!r} does not take fds"))
            return False
        if cmd in proto.UPDATE_COMMANDS and self.updates is not None:
            self._update_command(c, cmd, req, fds)
            return True
        if cmd == "watch" and isinstance(req.get("participant"), dict) and self.updates:
            self._participate(c, req["participant"])
            return False
        if cmd == "watch":
            if self._watch(c.conn, c.peer):
                self._to_watch_pool(c)
                self._hold_watch(c.conn)
            return False  # refused (`busy` sent) or done watching: the connection closes
        self._command(c, cmd, req)
        return True

    def _update_command(self, c: Connection, cmd: str, req: dict[str, Any],
                        fds: list[int]) -> None:
        """An update phase (or `get_table`): the updater's, reserved to our own uid."""
        assert self.updates is not None
        if c.peer[1] != os.getuid() and cmd != "get_table":
            # Engines of other uids may read the cache, never rewrite it.
            _close_fds(fds)
            self.stats.request(cmd, proto.E_PERMISSION_DENIED)
            proto.send_frame(c.conn, proto.error(
                proto.E_PERMISSION_DENIED, f"{cmd} is reserved to uid {os.getuid()}"))
            return
        try:
            reply = self.updates.handle(c.conn, cmd, req, fds)
        except Exception as exc:  # a bug must not take the rank down
            log.exception("command %s failed", cmd)
            reply = proto.error(proto.E_INTERNAL, f"{type(exc).__name__}: {exc}")
        self.stats.request(cmd, "ok" if reply.get("ok") else reply.get("error", "?"))
        proto.send_frame(c.conn, reply)

    def _participate(self, c: Connection, spec: dict[str, Any]) -> None:
        """An engine's update stream: a watcher (watch pool) that also answers."""
        assert self.updates is not None
        why = self._watch_slots.acquire(c.peer[0], c.peer[1])
        if why:
            self.stats.request("watch", proto.E_BUSY)
            proto.send_frame(c.conn, proto.error(proto.E_BUSY, f"watch: {why}"))
            return
        self._to_watch_pool(c)
        self.stats.request("watch", "ok")
        self.stats.adjust("watchers", 1)
        self._watchers.add(c.conn)
        try:
            self.updates.participate(c.conn, c.peer[0], spec)
        finally:
            self._watchers.discard(c.conn)
            self.stats.adjust("watchers", -1)

    def _to_watch_pool(self, c: Connection) -> None:
        """A watcher holds a watch slot (taken already), no longer an attach slot."""
        self._slots.release(c.peer[0], c.peer[1])
        c.pool = self._watch_slots

    def _command(self, c: Connection, cmd: str, req: dict[str, Any]) -> None:
        """One of `protocol.COMMANDS`: its `cmd_*` method's reply, with the fds it hands out."""
        handler = getattr(self, f"cmd_{cmd}", None) if cmd in proto.COMMANDS else None
        if handler is None:
            self.stats.request("unknown", proto.E_UNKNOWN_COMMAND)
            proto.send_frame(
                c.conn, proto.error(proto.E_UNKNOWN_COMMAND, f"unknown command {cmd!r}"))
            return
        try:
            reply, fds = handler(req, c.peer[0]) if cmd == "get_state" else handler(req)
        except Exception as exc:  # a bug must not take the rank down
            log.exception("command %s failed", cmd)
            reply, fds = proto.error(proto.E_INTERNAL, f"{type(exc).__name__}: {exc}"), []
        self.stats.request(cmd, "ok" if reply.get("ok") else reply.get("error", "error"))
        try:
            proto.send_frame(c.conn, reply, fds)
        finally:
            _close_fds(fds)
        if cmd == "get_state" and reply.get("ok"):
            # A claim still owed: the attach is counted once the claim holds (check_claim).
            c.claim_owed = req.get("claim") == "after"
            c.served_state = not c.claim_owed
        elif cmd == "check_claim" and reply.get("ok") and c.claim_owed:
            c.claim_owed, c.served_state = False, True

    def _close(self, c: Connection) -> None:
        """Abort the update this connection staged, count the attach, free its slot."""
        if self.updates is not None:
            self.updates.connection_closed(c.conn)
        with contextlib.suppress(OSError):
            c.conn.close()
        if c.served_state:
            self.stats.attach(time.monotonic() - c.started)
        self.stats.adjust("connections", -1)
        c.pool.release(c.peer[0], c.peer[1])

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
        """Serve until stopped: threads accept and serve the connections (handlers.py), this
        one waits. A process-directed signal may be delivered to any of torch's threads; then
        Python's handler waits until the main thread runs bytecode again, so it wakes now
        and then (ACCEPT_WAKE_S) to let the handler run (it shuts the listener down)."""
        self._acceptors = Acceptors(listener, self._take, "weightcache-conn",
                                    limit=MAX_CONNECTIONS + limits.MAX_WATCHERS + 1).start()
        try:
            while not self.stopping.is_set():
                self._acceptors.wake.wait(ACCEPT_WAKE_S)
                if self.stopping.is_set():
                    return
                if self._acceptors.error is not None:
                    raise self._acceptors.error
        finally:
            self._acceptors.close()

    def _take(self, conn: socket.socket) -> Callable[[], None]:
        """A new connection, in the order connections came (handlers.py): its peer gets a
        slot, or is refused; what this connection's thread does next."""
        try:
            peer = peer_credentials(conn)
        except OSError:
            return conn.close
        why = self._slots.acquire(peer[0], peer[1])
        if why:
            return lambda: self._refuse(conn, why)
        return lambda: self.handle(conn, peer)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.stats.request("connect", proto.E_BUSY)
        with contextlib.suppress(OSError, proto.ProtocolError):
            conn.settimeout(0.5)
            proto.send_frame(conn, proto.error(proto.E_BUSY, why))
        conn.close()

    def shutdown(self) -> None:
        self.stopping.set()
        if self._acceptors is not None:
            self._acceptors.close()
        for conn in list(self._watchers):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._state_lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None


def shipped_plan(shard: LoadedShard, config: RankConfig,
                 ckpt: Checkpoint) -> tuple[dict[str, Any], bytes] | None:
    """The key and table this rank ships to engines (plantable.py), from the checkpoint its
    plan was made of; None when the table cannot be encoded (engines plan themselves)."""
    fingerprint, layout = shard.fingerprint, shard.layout
    key = plantable.plan_key(
        checkpoint=fingerprint["checkpoint"], index=ckpt.index_digest, config=ckpt.config_digest,
        tp_size=config.tp_size, tp_rank=config.tp_rank, shard_rules=fingerprint["shard_rules"],
        runtime_version=fingerprint["runtime_version"])
    share = None if config.tp_size == 1 else {
        p.name: sorted(c) for p, c in coldload.share_chunks(list(layout.entries)).items()}
    blob = plantable.encode(layout, key, fingerprint["dtype"], share)
    return None if blob is None else (key, blob)


def serve_shard(shard: LoadedShard, config: RankConfig, rules: list[ShardRule],
                ckpt: Checkpoint | None = None) -> RankServer:
    """The server of a loaded shard, with its updater (in-place updates re-plan the same way);
    with the checkpoint its plan was made of, it ships that plan to engines."""
    server = RankServer(
        arena=shard.arena,
        transport_name=shard.transport.name,
        layout=shard.layout,
        fingerprint=shard.fingerprint,
        identity=device_identity(config.device, config.device_index),
        device=shard.device,
        rank=config.tp_rank,
        tp_size=config.tp_size,
        role=config.role,
        global_rank=config.global_rank,
        dp_rank=config.dp_rank,
        load_seconds=shard.load_seconds,
        allowed_uids={os.getuid(), *config.allowed_uids},
        content=shard.record,
    )
    if ckpt is not None:
        server.ship_plan(lambda: shipped_plan(shard, config, ckpt))
    server.updates = RankUpdater(server, UpdateConfig(
        rules=rules, tp_size=config.tp_size, tp_rank=config.tp_rank, dtype=config.dtype,
        model=str(config.model)))
    return server
