"""In-place update of one daemon rank: stage, pause, write, finish (docs/updates.md).

Why in place: a restart to a new revision makes a zero_copy engine keep the old arena mapped
while the daemon loads the new one, so the device holds two copies for a while. Writing the new
revision into the arena's existing memory grows device memory by 0 bytes and keeps every
tensor's address (captured CUDA graphs stay valid), at the price that the model must not run
while the bytes change. Hence the phases, each one command on the daemon socket, driven for all
ranks of a group together by a coordinator (`weightcache update`, `native/coordinator.py`):

  update_stage   read the new bytes into host staging (pinned on CUDA) and verify them while
                 engines keep serving; refuse a layout that differs from the cached one.
  update_pause   announce `begin` to every participant engine and wait (bounded) for each one's
                 `paused`; refuse if a zero_copy engine that cannot pause is attached.
  update_write   copy staging into the arena (memfd: the daemon's own writable mapping, made
                 before the file was sealed; CUDA: one host-to-device copy into the same
                 device allocation). From the first byte on, failing means broken.
  update_finish  the new fingerprint and generation become the rank's; `finish` is announced.
  update_abort   before the write: drop staging, resume engines on the old generation;
                 after it: write the previous generation back (rollback) when a copy of it
                 was kept, else mark the rank broken and tell engines (never silently torn).

Rollback: staging keeps a host copy of the bytes served now (the arena's size again, pinned
on CUDA) where host memory allows, so that a failure after the write, on this rank or on any
other rank or node of the group, puts every rank back on the old generation at the same
addresses instead of leaving it broken. Where memory does not allow, the update proceeds
without it and says so (`rollback: false`, `rollback_why`), unless the coordinator asked for
`rollback: "require"`, which is refused at stage (`no_rollback`).

The update belongs to the connection that staged it: if that connection goes away, the update
is aborted as by `update_abort`, so a dead coordinator never leaves engines paused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..shared import content as content_mod
from ..shared import hostmem
from ..shared import protocol as proto
from ..shared.cgroups import available_memory as host_memory_available
from ..shared.cgroups import usable_cpus
from ..shared.checkpoint import CheckpointError, open_checkpoint
from ..shared.errors import UpdateError
from ..shared.loader import ArenaLayout, ArenaLayoutError, load_into_arena
from ..shared.rankplan import plan_rank_shard
from ..shared.sharding import ShardingError, ShardRule
from . import staging
from .histogram import Histogram
from .staging import HostBuffer, Image, ImageRefused

if TYPE_CHECKING:
    from ..shared.transport import Arena


class ServedRank(Protocol):
    """What an update reads and replaces of the rank that serves (`rank.RankServer`).

    Stated here so that this module needs nothing of the server: the server holds an updater,
    never the other way round."""

    arena: Arena | None
    table: list[dict[str, Any]]
    aliases: dict[str, str]
    nbytes: int
    fingerprint: dict[str, Any]
    content: dict[str, content_mod.FileDigest]
    device: torch.device
    rank: int
    stopping: threading.Event

log = logging.getLogger("weightcache.update")

IDLE, STAGED, PAUSED, WRITTEN, BROKEN = "idle", "staged", "paused", "written", "broken"
DEFAULT_PAUSE_DEADLINE_S = 30.0
MAX_PAUSE_DEADLINE_S = 600.0
# Attaching engines wait this long for a running update to finish before they are refused.
ATTACH_WAIT_S = 60.0
MAX_NAMED = 16  # differing tensors named in a refusal
# Update / pause duration histogram bounds (seconds).
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MAX_PARTICIPANT_FRAME = 64 * 1024
CONTENT = "content"  # the fingerprint field of the exact content identity (native/content.py)
DIGEST_CHUNK = 64 << 20
# A participant that does not read its events within this long is dropped (never blocks us).
PARTICIPANT_SEND_TIMEOUT_S = 5.0
# Host memory a rollback copy must leave free (so the copy never pushes the node into OOM).
ROLLBACK_RESERVE_BYTES = hostmem.RESERVE_BYTES
ROLLBACK_MODES = ("auto", "require", "off")


@dataclass(frozen=True)
class UpdateConfig:
    """What the rank was started with: an update re-plans the new checkpoint the same way."""

    rules: list[ShardRule]
    tp_size: int
    tp_rank: int
    dtype: str
    model: str


def _refusal(exc: UpdateError) -> dict[str, Any]:
    """The error reply of a refused phase: its code, message and detail (`tensors`...)."""
    return proto.error(exc.code, str(exc), **exc.detail)


@dataclass
class Participant:
    """An engine's watch stream that takes part in updates (`native/engine/participant.py`)."""

    conn: socket.socket
    pid: int
    mode: str
    can_pause: bool
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    paused_for: str | None = None

    def send(self, event: dict[str, Any]) -> bool:
        try:
            with self.send_lock:
                proto.send_frame(self.conn, event)
            return True
        except (OSError, proto.ProtocolError):
            return False


@dataclass
class Staged:
    update_id: str
    owner: socket.socket
    buffer: Image  # the new bytes: the checkpoint's own pages, or a host buffer (staging.py)
    fingerprint: dict[str, Any]
    model: str
    source: str
    seconds: float
    digest: str
    record: dict[str, Any] = field(default_factory=dict)  # name -> content.FileDigest
    paused_at: float | None = None
    paused: int = 0
    forced: list[int] = field(default_factory=list)
    previous: Image | None = None  # the generation served before the write, to roll back to
    rollback_why: str = ""  # why no copy was kept
    phases: dict[str, Any] = field(default_factory=dict)  # seconds per step, and the read's rate


def layout_differences(
    old_table: list[dict[str, Any]], old_aliases: dict[str, str], new: ArenaLayout
) -> list[str]:
    """Names whose entry (dtype, shape, offset, size) or alias target differs, sorted."""
    old = {r["name"]: r for r in old_table}
    fresh = {r["name"]: r for r in new.table()}
    keys = ("dtype", "shape", "offset", "nbytes")
    names = {n for n in old.keys() ^ fresh.keys()}
    names |= {n for n in old.keys() & fresh.keys() if any(old[n][k] != fresh[n][k] for k in keys)}
    names |= {a for a in set(old_aliases) | set(new.aliases)
              if old_aliases.get(a) != new.aliases.get(a)}
    return sorted(names)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sha256(buf: torch.Tensor) -> str:
    """`sha256:` over the sha256 of each DIGEST_CHUNK of the staged bytes, in order.

    Chunked so that all cores hash at once (hashlib drops the GIL): the digest of 16 GB
    takes about a second instead of ten, off the pause but on the update's total time."""
    view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
    chunks = [view[i: i + DIGEST_CHUNK] for i in range(0, len(view), DIGEST_CHUNK)]
    with ThreadPoolExecutor(max_workers=min(16, usable_cpus())) as pool:
        parts = list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
    return "sha256:" + hashlib.sha256(b"".join(parts)).hexdigest()


class _Keeping:
    """The rollback copy of one stage, taken on its own thread beside the read."""

    def __init__(self, pool: ThreadPoolExecutor,
                 take: Callable[[], tuple[Image | None, str, float]], mode: str) -> None:
        self._pool, self._take, self._mode = pool, take, mode
        self._future: Future[None] | None = None
        self._value: tuple[Image | None, str, float] = (None, "", 0.0)

    def start(self) -> None:
        if self._future is None:
            self._future = self._pool.submit(self._run)

    def _run(self) -> None:
        self._value = self._take()

    def result(self) -> tuple[Image | None, str, float]:
        self.start()
        assert self._future is not None
        self._future.result()
        return self._value

    def wait_quietly(self) -> None:
        if self._future is not None:
            with contextlib.suppress(BaseException):
                self._future.result()
        self._value = (None, "", 0.0)

    def make_room(self, nbytes: int) -> None:
        """Host staging of `nbytes` comes after a copy that started for staging that needed
        no host memory: a host copy that leaves no room for it is dropped (refused under
        `rollback: require`), so that the two never push the node into OOM."""
        if self._future is None:
            return
        self._future.result()
        previous, _, seconds = self._value
        avail = host_memory_available()
        if previous is None or previous.kind != "host" or avail is None:
            return
        if avail >= nbytes + ROLLBACK_RESERVE_BYTES:
            return
        why = (f"host memory: staging on the host needs {nbytes} bytes plus "
               f"{ROLLBACK_RESERVE_BYTES} spare besides the rollback copy, {avail} available")
        del previous
        self._value = (None, why, seconds)  # frees the copy before staging is allocated
        if self._mode == "require":
            raise UpdateError(proto.E_NO_ROLLBACK, f"no rollback copy possible ({why})")


class RankUpdater:
    """The update state machine of one rank; every method runs under `self._lock`."""

    def __init__(self, server: ServedRank, config: UpdateConfig) -> None:
        self.server = server
        self.config = config
        self.generation = 1
        self.phase = IDLE
        self.model = config.model
        self.broken_reason: str | None = None
        self.staged: Staged | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._participants: dict[int, Participant] = {}
        self._attached: dict[int, str] = {}  # pid -> mode of engines that mapped the arena
        self.results: dict[str, int] = {}
        self.update_seconds = Histogram(BUCKETS)
        self.pause_seconds = Histogram(BUCKETS)

    # -- facts for other commands ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "generation": self.generation,
                "phase": self.phase,
                "model": self.model,
                CONTENT: self.server.fingerprint.get(CONTENT),
                "broken": self.broken_reason,
            }

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "generation": self.generation,
                "phase": self.phase,
                "results": dict(self.results),
                "update_seconds": self.update_seconds.snapshot(),
                "pause_seconds": self.pause_seconds.snapshot(),
                "participants": len(self._participants),
            }

    def attach(
        self, pid: int, mode: Any, export: Callable[[int], tuple[dict[str, Any], list[int]]]
    ) -> tuple[dict[str, Any], list[int]]:
        """`get_state` as one step against updates.

        Wait out a write and refuse a broken cache, then run `export(generation)` (identity
        check, table, fds) and count the engine, all under the lock: no pause, write or
        finish can fall between the identity check and the export (an engine would get the
        new bytes checked against the old identity), nor between the export and the engine
        being counted (a pause would not see it and would rewrite bytes it maps)."""
        deadline = time.monotonic() + ATTACH_WAIT_S
        with self._lock:
            while self.phase in (PAUSED, WRITTEN):
                left = deadline - time.monotonic()
                if left <= 0:
                    return proto.error(proto.E_BUSY, "an update is writing this rank's arena"), []
                self._changed.wait(left)
            if self.phase == BROKEN:
                return proto.error(proto.E_BROKEN, f"cache is broken: {self.broken_reason}"), []
            reply, fds = export(self.generation)
            if reply.get("ok"):
                self._note_attach(pid, mode)
            return reply, fds

    def release(
        self, drop: Callable[[], tuple[dict[str, Any], list[int]]]
    ) -> tuple[dict[str, Any], list[int]]:
        """`release` as one step against updates: refused (busy) while an update pauses
        engines or writes the arena, so a write never lands in an arena being freed and a
        pause is never left waiting for a rank that dropped its weights."""
        with self._lock:
            if self.phase in (PAUSED, WRITTEN):
                return proto.error(
                    proto.E_BUSY, f"an update is {self.phase} on this rank: release after it"), []
            return drop()

    def _note_attach(self, pid: int, mode: Any) -> None:
        """An engine mapped the arena (old clients send no mode: counted as zero_copy)."""
        self._attached[pid] = "copy" if mode == "copy" else "zero_copy"
        if len(self._attached) > 4096:  # bounded per-client state: drop the dead
            self._attached = {p: m for p, m in self._attached.items() if _pid_alive(p)}

    def _blockers(self) -> list[dict[str, Any]]:
        """zero_copy engines that will not pause: no participant stream, or one that says so."""
        participants = {p.pid: p for p in self._participants.values()}
        out = []
        for pid, mode in sorted(self._attached.items()):
            if mode != "zero_copy" or not _pid_alive(pid):
                continue
            part = participants.get(pid)
            if part is None:
                out.append({"pid": pid, "why": "attached zero_copy without an update participant"})
        for part in participants.values():
            if part.mode == "zero_copy" and not part.can_pause:
                out.append({"pid": part.pid, "why": "participant cannot pause"})
        return out

    # -- participant streams ---------------------------------------------------------------
    def participate(self, conn: socket.socket, pid: int, spec: dict[str, Any]) -> None:
        """Serve one participant's watch stream until it closes (runs on its own thread)."""
        mode = "copy" if spec.get("mode") == "copy" else "zero_copy"
        part = Participant(conn, pid, mode, bool(spec.get("can_pause", True)))
        with self._lock:
            self._participants[id(part)] = part
            hello = proto.ok(watching=True, rank=self.server.rank, generation=self.generation,
                             phase=self.phase)
            part.send(hello)
            if self.phase == BROKEN:  # a late registrant is told as the others were
                part.send(self._broken_event())
        try:
            conn.settimeout(PARTICIPANT_SEND_TIMEOUT_S)  # bounds our sends to it
            while not self.server.stopping.is_set():
                try:
                    msg, _ = proto.recv_frame(conn, max_frame=MAX_PARTICIPANT_FRAME)
                except TimeoutError:
                    continue  # an idle participant is fine; only a full frame counts
                if msg.get("ack") == "paused" and isinstance(msg.get("update"), str):
                    with self._lock:
                        part.paused_for = msg["update"]
                        self._changed.notify_all()
        except (OSError, proto.ProtocolError):
            pass
        finally:
            with self._lock:
                self._participants.pop(id(part), None)
                self._changed.notify_all()

    def _broadcast(self, event: dict[str, Any]) -> None:
        for part in list(self._participants.values()):
            part.send(event)

    # -- commands ---------------------------------------------------------------------------
    def handle(
        self, conn: socket.socket, cmd: str, req: dict[str, Any], fds: list[int]
    ) -> dict[str, Any]:
        try:
            if cmd == "update_stage":
                return self._stage(conn, req, fds)
            with self._lock:
                if cmd == "get_table":  # in pages: any table fits the frame limit
                    start = req.get("start", 0)
                    if (not isinstance(start, int) or isinstance(start, bool)
                            or not 0 <= start <= len(self.server.table)):
                        raise UpdateError(proto.E_BAD_REQUEST, "get_table: bad start")
                    rows, following = proto.table_page(self.server.table, start)
                    return proto.ok(tensors=rows, next=following, total=len(self.server.table),
                                    aliases=self.server.aliases, bytes=self.server.nbytes,
                                    generation=self.generation)
                staged = self._owned(conn, req)
                if cmd == "update_pause":
                    return self._pause(staged, req)
                if cmd == "update_write":
                    return self._write(staged)
                if cmd == "update_finish":
                    return self._finish(staged)
                if cmd == "update_abort":
                    return self._abort(staged, "aborted by the coordinator")
        except UpdateError as exc:
            if cmd != "update_stage" and exc.code not in (proto.E_BROKEN, proto.E_ROLLED_BACK):
                self._count("refused" if exc.code != proto.E_PAUSE_TIMEOUT else "timeout")
            return _refusal(exc)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return proto.error(proto.E_UNKNOWN_COMMAND, f"unknown update command {cmd!r}")

    HOLD_S = 600.0  # the longest a staging connection may wait between phases

    def owns(self, conn: socket.socket) -> bool:
        with self._lock:
            return self.staged is not None and self.staged.owner is conn

    def connection_closed(self, conn: socket.socket) -> None:
        with self._lock:
            if self.staged is not None and self.staged.owner is conn:
                self._abort(self.staged, "the coordinator's connection closed")

    def _count(self, result: str) -> None:
        self.results[result] = self.results.get(result, 0) + 1

    def _owned(self, conn: socket.socket, req: dict[str, Any]) -> Staged:
        staged = self.staged
        if staged is None or staged.update_id != req.get("update"):
            raise UpdateError(proto.E_UPDATE_STATE, "no such staged update on this connection")
        if staged.owner is not conn:
            raise UpdateError(proto.E_UPDATE_STATE, "the update belongs to another connection")
        return staged

    def _stage(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        with self._lock:
            if self.phase not in (IDLE, BROKEN) or self.staged is not None:
                raise UpdateError(proto.E_UPDATE_STATE, f"an update is already {self.phase}")
            if self.server.arena is None:
                raise UpdateError(proto.E_RELEASED, "the cache was released")
            # Reserve the slot so that a second coordinator is refused while we read.
            self.staged = Staged("", conn, HostBuffer(torch.empty(0, dtype=torch.uint8)), {}, "",
                                 "", 0, "")
        try:
            mode = req.get("rollback", "auto")
            if mode not in ROLLBACK_MODES:
                raise UpdateError(proto.E_BAD_REQUEST, f"rollback must be one of {ROLLBACK_MODES}")
            # The rollback copy is taken while the new bytes are read: both happen while
            # engines keep serving, and neither waits for the other. It starts once staging
            # took its host memory, so that it sees the memory left then (a push allocates
            # inside its copy: its rollback copy starts after it).
            with ThreadPoolExecutor(1, thread_name_prefix="weightcache-rollback") as pool:
                keeping = _Keeping(pool, lambda: self._previous_copy(mode), mode)
                try:
                    staged = self._read(conn, req, fds, keeping)
                except BaseException:
                    keeping.wait_quietly()  # and drop it
                    raise
                staged.previous, staged.rollback_why, rollback_s = keeping.result()
            staged.phases["rollback_seconds"] = round(rollback_s, 6)
            staged.phases["rollback_source"] = None if staged.previous is None else (
                "files" if staged.previous.kind == "files" else "device")
            if staged.previous is not None and staged.previous.nbytes != staged.buffer.nbytes:
                staged.previous, staged.rollback_why = None, "the arena's size changed"
        except BaseException:
            with self._lock:
                self.staged = None
                self._count("refused")
            raise
        with self._lock:
            self.staged = staged
            self.phase = STAGED if self.phase != BROKEN else BROKEN
        log.info("rank %d staged update %s from %s (%d bytes, %.3f s)", self.server.rank,
                 staged.update_id, staged.source, staged.buffer.nbytes, staged.seconds)
        return proto.ok(update=staged.update_id, generation=self.generation,
                        next_generation=self.generation + 1, bytes=staged.buffer.nbytes,
                        seconds=round(staged.seconds, 6), digest=staged.digest,
                        phases=staged.phases,
                        fingerprint=staged.fingerprint,
                        blockers=self._locked(self._blockers),
                        rollback=staged.previous is not None, rollback_why=staged.rollback_why)

    def _locked(self, fn: Any) -> Any:
        with self._lock:
            return fn()

    def _read(self, conn: socket.socket, req: dict[str, Any], fds: list[int],
              keeping: _Keeping) -> Staged:
        """Stage and verify the new bytes; nothing the engines see changes here."""
        t0 = time.monotonic()
        cfg, server = self.config, self.server
        source = req.get("source", "checkpoint")
        if source == "checkpoint":
            model = req.get("model")
            if not isinstance(model, str) or not model:
                raise UpdateError(proto.E_BAD_REQUEST, "update_stage needs a model directory")
            try:
                ckpt = open_checkpoint(model)
                layout, fingerprint = plan_rank_shard(ckpt, cfg.rules, tp_size=cfg.tp_size,
                                                      tp_rank=cfg.tp_rank, dtype=cfg.dtype)
            except (CheckpointError, ShardingError, OSError) as exc:
                raise UpdateError(proto.E_BAD_REQUEST, str(exc)) from None
            diff = layout_differences(server.table, server.aliases, layout)
            if diff:
                raise UpdateError(
                    proto.E_LAYOUT_MISMATCH,
                    f"{len(diff)} tensors differ from the cached layout (a restart is needed): "
                    + ", ".join(diff[:MAX_NAMED]),
                    detail={"tensors": diff[:MAX_NAMED], "count": len(diff)},
                )
            try:
                before = {p.name: content_mod.FileIdentity.of(os.stat(p)) for p in ckpt.files}
            except OSError as exc:
                raise UpdateError(proto.E_BAD_REQUEST, f"cannot read {model}: {exc}") from None
            t_alloc = time.monotonic()
            buffer, record, phases = self._stage_bytes(model, ckpt, layout, keeping)
            # The exact identity engines' claims are checked against (content.py): the files
            # planned must be the ones staged.
            if any(record[n].identity != ident for n, ident in before.items()):
                raise UpdateError(proto.E_BAD_REQUEST,
                                  f"{model} changed while it was being staged; retry")
            phases = {"plan_seconds": round(t_alloc - t0, 6), **phases}
            root = content_mod.content_root(record)
            fingerprint = {**fingerprint, CONTENT: root}
            # The staged bytes are the files' bytes, which the content root names already:
            # no second pass over the staging buffer.
            digest = "content:" + root
        elif source == "push":
            if len(fds) != 1:
                raise UpdateError(proto.E_BAD_REQUEST, "a push carries exactly one memfd")
            model = "push"
            phases = {"staging": "host"}
            pushed = self._read_push(fds[0])
            keeping.start()
            digest = _sha256(pushed)
            buffer = HostBuffer(pushed)
            # Served bytes no longer equal any checkpoint on disk: no engine asking for one
            # may match them, while the layout (and so every other field) is unchanged.
            fingerprint = {**server.fingerprint, CONTENT: "push:" + digest}
            record = {}  # no file on disk holds these bytes: every claim is refused
        else:
            raise UpdateError(proto.E_BAD_REQUEST, f"unknown update source {source!r}")
        return Staged(uuid.uuid4().hex, conn, buffer, fingerprint, model, source,
                      time.monotonic() - t0, digest, record, phases=phases)

    def _stage_bytes(self, model: str, ckpt: Any, layout: ArenaLayout,
                     keeping: _Keeping) -> tuple[Image, dict[str, Any], dict[str, Any]]:
        """The new bytes, verified by one read: (staging, content record, phases).

        From the files' own pages where the layout allows (staging.py), else into a host
        buffer by the parallel loader. The rollback copy starts once staging's host memory is
        taken (`keeping`): at once for the files' pages, which take none."""
        cfg, server = self.config, self.server
        share = cfg.tp_size > 1
        why = staging.refusal(layout, server.device)
        if why is None:
            keeping.start()
            t0 = time.monotonic()
            try:
                image, steps = staging.file_image(layout, list(ckpt.files), server.device,
                                                  share=share)
            except content_mod.ContentError as exc:
                raise UpdateError(proto.E_BAD_REQUEST, f"cannot read {model}: {exc}") from None
            except ImageRefused as exc:
                why = str(exc)
                log.info("rank %d: staging on the host (%s)", server.rank, why)
            else:
                seconds = time.monotonic() - t0
                return image, image.record, {
                    "staging": "files", "allocate_seconds": round(steps.get("pin_seconds", 0), 6),
                    "read_seconds": round(seconds, 6),
                    "read_gb_per_s": round(layout.nbytes / max(seconds, 1e-9) / 1e9, 3),
                    "read_threads": usable_cpus(),
                    "digest_seconds": round(steps["digest_seconds"], 6)}
        keeping.make_room(layout.nbytes)  # a copy started for a refused image
        t_alloc = time.monotonic()
        buffer = staging.host_buffer(layout.nbytes, server.device)
        keeping.start()
        t_read = time.monotonic()
        try:
            # One pass: the parallel loader reads every byte of the files once into
            # staging and digests it from there; the files' identities bracket it.
            stats = load_into_arena(layout, buffer, digest=list(ckpt.files), share=share)
        except (ArenaLayoutError, content_mod.ContentError, OSError, RuntimeError) as exc:
            raise UpdateError(proto.E_BAD_REQUEST, f"cannot read {model}: {exc}") from None
        return HostBuffer(buffer), stats.record or {}, {
            "staging": "host", "staging_why": why,
            "allocate_seconds": round(t_read - t_alloc, 6),
            "read_seconds": round(time.monotonic() - t_read, 6),
            "read_gb_per_s": round(stats.gbps, 3), "read_threads": stats.threads}

    def _previous_copy(self, mode: str) -> tuple[Image | None, str, float]:
        """The bytes served now, kept so that a failure after the write can undo it: (the
        image or None, why none, seconds).

        The files the generation came from, where they are the very files its record names,
        unchanged, and the page cache holds them (staging.py: no memory of ours, no copy);
        else a copy of the arena in host memory (pinned on CUDA), which costs the arena's size
        from stage to finish on top of host staging. Taken while engines keep serving
        (nothing writes the arena before `update_write`, and the reserved slot keeps any other
        update out)."""
        t0 = time.monotonic()
        device = self.server.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            previous, why = self._keep_previous(mode)
        return previous, why, time.monotonic() - t0

    def _keep_previous(self, mode: str) -> tuple[Image | None, str]:
        if mode == "off":
            return None, "no rollback copy requested"
        nbytes = self.server.nbytes
        with self._lock:
            broken, arena, model = self.phase == BROKEN, self.server.arena, self.model
        if arena is None:
            raise UpdateError(proto.E_RELEASED, "the cache was released")
        if not broken:
            served = self._served_files(model)
            if served is not None:
                return served, ""
        avail = host_memory_available()
        if broken:
            why = "the rank is broken: there is no whole generation to roll back to"
        elif avail is not None and avail < nbytes + ROLLBACK_RESERVE_BYTES:
            why = (f"host memory: a rollback copy needs {nbytes} bytes plus "
                   f"{ROLLBACK_RESERVE_BYTES} spare, {avail} available")
        else:
            why = ""
        if why and mode == "require":
            raise UpdateError(proto.E_NO_ROLLBACK, f"no rollback copy possible ({why})")
        if why:
            log.warning("rank %d: update without rollback: %s", self.server.rank, why)
            return None, why
        previous = staging.host_buffer(nbytes, self.server.device)
        src = arena.tensor()[:nbytes]
        previous.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        del src
        return HostBuffer(previous), ""

    def _served_files(self, model: str) -> Image | None:
        """The served generation's own files as a rollback source, or None (then a copy)."""
        cfg, server = self.config, self.server
        if not server.content:
            return None  # a pushed generation: no file holds its bytes
        try:
            ckpt = open_checkpoint(model)
            layout, _ = plan_rank_shard(ckpt, cfg.rules, tp_size=cfg.tp_size,
                                        tp_rank=cfg.tp_rank, dtype=cfg.dtype)
            if layout_differences(server.table, server.aliases, layout):
                raise ImageRefused("their layout is not the one served")
            image, _ = staging.file_image(layout, list(ckpt.files), server.device,
                                          share=cfg.tp_size > 1, known=server.content,
                                          resident_only=True, pin_later=True)
        except (ImageRefused, CheckpointError, ShardingError, content_mod.ContentError,
                OSError) as exc:
            log.info("rank %d: rollback from %s refused (%s): a copy of the arena instead",
                     server.rank, model, exc)
            return None
        return image

    def _read_push(self, fd: int) -> torch.Tensor:
        """Copy a pushed memfd (the rank's arena image) into staging; never map it writable."""
        nbytes = self.server.nbytes
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise UpdateError(proto.E_BAD_REQUEST, f"cannot stat the pushed fd: {exc}") from None
        if size != nbytes:
            raise UpdateError(proto.E_LAYOUT_MISMATCH,
                              f"pushed image has {size} bytes, the arena {nbytes}")
        buffer = staging.host_buffer(nbytes, self.server.device)
        if nbytes:
            with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as view:
                src = torch.frombuffer(view, dtype=torch.uint8)
                buffer.copy_(src)
                del src
        return buffer

    def _pause(self, staged: Staged, req: dict[str, Any]) -> dict[str, Any]:
        if self.phase not in (STAGED, BROKEN):
            raise UpdateError(proto.E_UPDATE_STATE, f"cannot pause: update is {self.phase}")
        force = bool(req.get("force", False))
        deadline_s = req.get("deadline_s", DEFAULT_PAUSE_DEADLINE_S)
        if not isinstance(deadline_s, int | float) or not 0 < deadline_s <= MAX_PAUSE_DEADLINE_S:
            raise UpdateError(proto.E_BAD_REQUEST,
                              f"deadline_s must be in (0, {MAX_PAUSE_DEADLINE_S}]")
        blockers = self._blockers()
        if blockers and not force:
            pids = ", ".join(str(b["pid"]) for b in blockers)
            raise UpdateError(
                proto.E_UNPAUSABLE,
                f"zero_copy engines that cannot pause are attached (pid {pids}); "
                "use --force to update anyway",
                detail={"engines": blockers},
            )
        staged.forced = [b["pid"] for b in blockers]
        previous = self.phase
        self.phase = PAUSED
        staged.paused_at = time.monotonic()
        waiting = [p for p in self._participants.values() if p.mode == "zero_copy"]
        begin = {"event": "begin", "update": staged.update_id, "generation": self.generation}
        for part in waiting:
            part.paused_for = None
            if not part.send(begin):
                part.paused_for = staged.update_id  # a closed stream runs nothing any more
        end = time.monotonic() + float(deadline_s)
        while True:
            late = [p for p in waiting if p.paused_for != staged.update_id
                    and id(p) in self._participants]
            left = end - time.monotonic()
            if not late or left <= 0:
                break
            self._changed.wait(left)
        if late:
            self.phase = previous
            self._resume(staged, changed=False)
            pids = ", ".join(str(p.pid) for p in late)
            raise UpdateError(proto.E_PAUSE_TIMEOUT,
                              f"engines did not pause within {deadline_s} s (pid {pids})",
                              detail={"engines": [p.pid for p in late]})
        staged.paused = len(waiting)
        return proto.ok(update=staged.update_id, paused=len(waiting), forced=staged.forced)

    def _write(self, staged: Staged) -> dict[str, Any]:
        if self.phase != PAUSED:
            raise UpdateError(proto.E_UPDATE_STATE, f"cannot write: update is {self.phase}")
        arena = self.server.arena
        if arena is None:
            raise UpdateError(proto.E_RELEASED, "the cache was released")
        try:
            staged.buffer.verify()  # nothing is written yet: refused, the engines resume
        except content_mod.ContentError as exc:
            raise UpdateError(proto.E_BAD_REQUEST, f"{exc}: stage the update again") from None
        self.phase = WRITTEN  # from here on, a failure tears the arena: roll back, or broken
        t0 = time.monotonic()
        try:
            staged.buffer.write_into(arena.tensor())
        except Exception as exc:
            why = f"write failed: {type(exc).__name__}: {exc}"
            if self._roll_back(staged, why):
                raise UpdateError(proto.E_ROLLED_BACK, f"{why}; the previous generation was "
                                  "written back", detail={"rolled_back": True}) from None
            self._mark_broken(why)
            self._count("failed")
            raise UpdateError(proto.E_BROKEN, f"write failed, cache marked broken: {exc}") from None
        return proto.ok(update=staged.update_id, seconds=round(time.monotonic() - t0, 6))

    def _finish(self, staged: Staged) -> dict[str, Any]:
        if self.phase != WRITTEN:
            raise UpdateError(proto.E_UPDATE_STATE, f"cannot finish: update is {self.phase}")
        self.server.fingerprint = staged.fingerprint
        self.server.content = staged.record
        self.generation += 1
        self.model = staged.model
        self.broken_reason = None
        paused_s = time.monotonic() - (staged.paused_at or time.monotonic())
        self._resume(staged, changed=True)
        self._count("ok")
        self.pause_seconds.observe(paused_s)
        self.update_seconds.observe(staged.seconds + paused_s)
        log.info("rank %d now serves generation %d (%s), paused %.3f s", self.server.rank,
                 self.generation, staged.model, paused_s)
        return proto.ok(update=staged.update_id, generation=self.generation,
                        paused_seconds=round(paused_s, 6), identity=self._identity())

    def _identity(self) -> dict[str, Any]:
        f = self.server.fingerprint
        return {"checkpoint": f.get("checkpoint"), CONTENT: f.get(CONTENT)}

    def _abort(self, staged: Staged, why: str) -> dict[str, Any]:
        if self.phase == WRITTEN and self._roll_back(staged, why):
            return proto.ok(aborted=True, rolled_back=True, phase=self.phase,
                            generation=self.generation)
        if self.phase == WRITTEN:
            self._mark_broken(f"update aborted after the write began: {why}")
            self._count("failed")
        elif self.phase == PAUSED:
            self.phase = STAGED
            self._resume(staged, changed=False)
            self._count("aborted")
        else:
            self._count("aborted")
        if self.phase == STAGED:
            self.phase = IDLE
        self.staged = None
        self._changed.notify_all()
        return proto.ok(aborted=True, phase=self.phase, generation=self.generation)

    def _roll_back(self, staged: Staged, why: str) -> bool:
        """Write the kept previous generation back into the same memory (same addresses) and
        resume engines on it, unchanged; False when no copy was kept or the copy-back failed
        (the caller then marks the rank broken)."""
        arena = self.server.arena
        if staged.previous is None or arena is None:
            return False
        try:
            staged.previous.write_into(arena.tensor())
        except Exception as exc:
            log.error("rank %d: rollback failed: %s: %s", self.server.rank,
                      type(exc).__name__, exc)
            return False
        self.phase = IDLE
        self.staged = None
        self._resume(staged, changed=False, rolled_back=True)
        self._count("rolled_back")
        log.warning("rank %d rolled back to generation %d (%s; %s, pinned in %.3f s)",
                    self.server.rank, self.generation, why, staged.previous.kind,
                    getattr(staged.previous, "pin_seconds", 0.0))
        return True

    def _resume(self, staged: Staged, *, changed: bool, rolled_back: bool = False) -> None:
        event: dict[str, Any] = {"event": "finish" if changed else "resumed",
                                 "update": staged.update_id, "generation": self.generation,
                                 "changed": changed}
        if rolled_back:
            event["rolled_back"] = True
        if changed:
            event["identity"] = self._identity()
            self.phase = IDLE
            self.staged = None
        self._broadcast(event)
        self._changed.notify_all()

    def _mark_broken(self, why: str) -> None:
        self.phase = BROKEN
        self.broken_reason = why
        self.staged = None
        log.error("rank %d cache broken: %s", self.server.rank, why)
        self._broadcast(self._broken_event())
        self._changed.notify_all()

    def _broken_event(self) -> dict[str, Any]:
        return {"event": "broken", "generation": self.generation, "message": self.broken_reason}
