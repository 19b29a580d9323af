"""`weightcache update`: switch every daemon rank of this node to a new revision in place.

The coordinator holds one connection per rank and moves all of them through the phases of
`native/daemon/updater.py` together, so the ranks of a group switch at one barrier or none does:

  1. stage on every rank (in parallel; engines keep serving);   any refusal -> abort all
  2. pause on every rank (begin; wait for the engines' acks);     any refusal -> abort all
  3. write on every rank (in parallel);                           any failure -> abort all,
                                                                  which rolls written ranks back
                                                                  (or marks them broken where no
                                                                  copy of the old bytes was kept)
  4. finish on every rank (new generation, `finish` announced).

Before step 3 an abort leaves every rank serving the old generation; between 3 and 4 too, where
each rank kept a host copy of its old bytes (`rollback`, docs/updates.md). Prints one JSON line:
generation, bytes, seconds staged, seconds paused, engines paused. Exit codes: 0 updated,
1 the update failed or was refused (the JSON has "error" and "message"), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.cliformat import HelpFormatter
from weightcache.contracts.vocabulary import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_UPDATE_FAILED,
    ROLE_TARGET,
    ROLES,
    canonical_role,
)

from .shared import protocol
from .shared.checkpoint import CheckpointError, open_checkpoint
from .shared.connection import connect, request
from .shared.errors import UpdateError, WeightCacheError
from .shared.security import SecurityError, resolve_socket_dir

if TYPE_CHECKING:
    import torch


def discover(socket_dir: Path, role: str = ROLE_TARGET) -> list[Path]:
    """Every daemon socket of this node in `socket_dir` of one role (one per rank)."""
    role = canonical_role(role)
    suffix = ".sock" if role == ROLE_TARGET else f"_{role}.sock"
    found = []
    for path in sorted(socket_dir.iterdir()):
        # Identities hold no "_" (GPU UUIDs, cpu-<hash>-<i>): only role suffixes do.
        if not path.name.endswith(suffix) or (role == ROLE_TARGET and "_" in path.name):
            continue
        if path.is_socket() and not path.is_symlink():
            found.append(path)
    return found


class _Rank:
    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.sock: socket.socket = connect(path, timeout=timeout_s)
        self.update_id: str | None = None
        self.staged: dict[str, Any] = {}
        self.written = False
        self.rolled_back = False  # its bytes were written and then put back
        self.lost = False  # its connection broke: the daemon died or closed it

    def call(self, cmd: str, fds: list[int] | None = None, **fields: Any) -> dict[str, Any]:
        """One request; a broken connection is an `unavailable` reply, never an exception:
        the daemon aborted (or rolled back) the update itself when the connection closed."""
        try:
            return self._call(cmd, fds, **fields)
        except (OSError, WeightCacheError) as exc:
            self.lost = True
            return {"ok": False, "error": "unavailable",
                    "message": f"daemon connection lost during {cmd}: {exc}"}

    def _call(self, cmd: str, fds: list[int] | None = None, **fields: Any) -> dict[str, Any]:
        if fds:
            try:
                protocol.send_frame(self.sock, {"cmd": cmd, **fields}, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            reply, _ = protocol.recv_frame(self.sock)
        else:
            reply, _ = request(self.sock, cmd, **fields)
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _all(ranks: list[_Rank], fn: Callable[[_Rank], dict[str, Any]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, len(ranks))) as pool:
        return list(pool.map(fn, ranks))


def _failed(replies: list[dict[str, Any]], ranks: list[_Rank]) -> tuple[str, str] | None:
    for reply, rank in zip(replies, ranks, strict=True):
        if not reply.get("ok"):
            return str(reply.get("error")), f"{rank.path.name}: {reply.get('message')}"
    return None


class GroupUpdate:
    """One update of a set of ranks, phase by phase, so that a caller can put a barrier between
    phases: the node agent lifts it across nodes (prepare everywhere, pause everywhere, commit
    everywhere; any refusal before commit aborts everywhere). The connections stay open between
    phases because a rank's update belongs to the connection that staged it."""

    def __init__(self, sockets: list[Path | str | os.PathLike], *,
                 timeout_s: float = 600.0) -> None:
        if not sockets:
            raise UpdateError("no_daemons", "no daemon sockets to update")
        self.ranks: list[_Rank] = []
        try:
            for p in sockets:
                self.ranks.append(_Rank(Path(p), timeout_s))
        except WeightCacheError as exc:
            self.close()
            raise UpdateError("unavailable", str(exc)) from None
        self.report: dict[str, Any] = {"ranks": len(self.ranks)}
        self._t0 = time.monotonic()
        self._t_pause = 0.0

    def prepare(self, *, model: str | None = None,
                pushes: Mapping[Any, Mapping[str, Any]] | None = None,
                force: bool = False, rollback: str = "auto") -> dict[str, Any]:
        """Stage on every rank (engines keep serving). Raises UpdateError after aborting.

        `rollback` (auto, require, off): whether each rank keeps a host copy of its current
        bytes, so that a failure after the write restores them; the report's `rollback` says
        whether every rank did."""
        def stage(rank: _Rank) -> dict[str, Any]:
            if pushes is None:
                return rank.call("update_stage", source="checkpoint", model=str(model),
                                 rollback=rollback)
            key = next(k for k in pushes if Path(k) == rank.path)
            table = rank.call("get_table")
            while table.get("ok") and table.get("next") is not None:  # later pages
                page = rank.call("get_table", start=table["next"])
                if not page.get("ok") or page.get("generation") != table.get("generation"):
                    return page if not page.get("ok") else {
                        "ok": False, "error": "update_state",
                        "message": "the table changed while it was read"}
                table = {**page, "tensors": table["tensors"] + page["tensors"]}
            if not table.get("ok"):
                return table
            try:
                fd = arena_image(table["tensors"], table["bytes"], pushes[key])
            except ValueError as exc:
                return {"ok": False, "error": "layout_mismatch", "message": str(exc)}
            return rank.call("update_stage", [fd], source="push", rollback=rollback)

        with self._aborting():
            replies = _all(self.ranks, stage)
            for reply, rank in zip(replies, self.ranks, strict=True):
                if reply.get("ok"):
                    rank.update_id, rank.staged = reply["update"], reply
            self.report["seconds_staged"] = round(time.monotonic() - self._t0, 6)
            self.report["bytes"] = sum(int(r.staged.get("bytes", 0)) for r in self.ranks)
            self.report["source"] = "push" if pushes is not None else str(model)
            if failed := _failed(replies, self.ranks):
                raise UpdateError(*failed, detail=_detail(replies))
            self.report["rollback"] = all(bool(r.get("rollback")) for r in replies)
            slowest = max(replies, key=lambda r: float(r.get("seconds", 0)))
            self.report["stage_phases"] = slowest.get("phases") or {}
            self.report["rollback_why"] = next(
                (str(r["rollback_why"]) for r in replies if r.get("rollback_why")), "")
            blockers = [b for r in replies for b in r.get("blockers", [])]
            if blockers and not force:
                pids = ", ".join(str(b["pid"]) for b in blockers)
                raise UpdateError(
                    "unpausable_engine",
                    f"zero_copy engines that cannot pause are attached (pid {pids});"
                    " use --force to update anyway", detail={"engines": blockers})
        return self.report

    def pause(self, *, force: bool = False, deadline_s: float = 30.0) -> dict[str, Any]:
        """`begin` on every rank; returns once every participant engine has paused."""
        with self._aborting():
            self._t_pause = time.monotonic()
            replies = _all(self.ranks, lambda r: r.call(
                "update_pause", update=r.update_id, force=force, deadline_s=deadline_s))
            if failed := _failed(replies, self.ranks):
                raise UpdateError(*failed, detail=_detail(replies))
            self.report["engines_paused"] = sum(int(r.get("paused", 0)) for r in replies)
            self.report["forced_engines"] = sorted({p for r in replies
                                                    for p in r.get("forced", [])})
        return self.report

    def write(self) -> dict[str, Any]:
        """Write on every rank; engines stay paused until `finish`. A failure anywhere aborts
        every rank: written ranks roll back where they kept a copy, else are marked broken
        (`UpdateError.broken`; `detail["rolled_back"]` says every rank serves the old bytes)."""

        def write(rank: _Rank) -> dict[str, Any]:
            rank.written = True  # whatever happens next, this rank's bytes may have changed
            reply = rank.call("update_write", update=rank.update_id)
            if not reply.get("ok"):  # the rank rolled back, is broken, or is gone
                rank.update_id = None
                rank.rolled_back = reply.get("error") == "rolled_back"
            return reply

        with self._aborting():
            replies = _all(self.ranks, write)
            if failed := _failed(replies, self.ranks):
                whole = self.abort()
                raise UpdateError(*failed, broken=not whole, detail={"rolled_back": whole})
            self.report["seconds_write"] = round(
                max(float(r.get("seconds", 0)) for r in replies), 6)
        return self.report

    def commit(self) -> dict[str, Any]:
        """Write (unless `write` ran) and finish on every rank. After the first rank finished
        nothing can be undone: a failure then marks the group broken."""
        if not all(r.written for r in self.ranks):
            self.write()
        with self._aborting():
            replies = _all(self.ranks, lambda r: r.call("update_finish", update=r.update_id))
            if failed := _failed(replies, self.ranks):
                raise UpdateError(*failed, broken=True)
            for rank in self.ranks:
                rank.update_id = None
        self.report.update(
            generation=max(int(r["generation"]) for r in replies),
            seconds_paused=round(time.monotonic() - self._t_pause, 6),
            seconds_total=round(time.monotonic() - self._t0, 6),
            identity=replies[0].get("identity"),
        )
        return self.report

    def abort(self) -> bool:
        """Nothing switches (before the write); after it, written ranks roll back (or are
        marked broken where no copy was kept). True when no rank is left broken: every written
        rank rolled back, or its daemon is gone (a restarted daemon loads from disk)."""
        for rank in self.ranks:
            if rank.update_id is not None:
                reply: dict[str, Any] = {}
                with contextlib.suppress(Exception):
                    reply = rank.call("update_abort", update=rank.update_id)
                rank.rolled_back = rank.rolled_back or bool(reply.get("rolled_back"))
                rank.update_id = None
        whole = all(r.rolled_back or r.lost or not r.written for r in self.ranks)
        self.report["rolled_back"] = whole and any(r.rolled_back for r in self.ranks)
        return whole

    @contextlib.contextmanager
    def _aborting(self):
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def update_group(
    sockets: list[Path | str | os.PathLike],
    *,
    model: str | None = None,
    pushes: Mapping[Any, Mapping[str, Any]] | None = None,
    force: bool = False,
    pause_deadline_s: float = 30.0,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Update every rank behind `sockets` to `model` (or to the pushed tensors) at one barrier."""
    group = GroupUpdate(sockets, timeout_s=timeout_s)
    try:
        group.prepare(model=model, pushes=pushes, force=force)
        group.pause(force=force, deadline_s=pause_deadline_s)
        report = group.commit()
    finally:
        group.close()
    keys = ("generation", "ranks", "bytes", "seconds_staged", "seconds_paused", "seconds_write",
            "seconds_total", "engines_paused", "forced_engines", "identity", "source",
            "stage_phases")
    return {k: report.get(k) for k in keys}


def arena_image(table: list[dict[str, Any]], nbytes: int,
                tensors: Mapping[str, torch.Tensor]) -> int:
    """A memfd holding `tensors` laid out as the rank's arena; every table row must be given."""
    import torch  # only a push needs torch: the node agent imports this module without it

    from .shared.loader import dtype_from_name
    fd = os.memfd_create("weightcache-push", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED) as view:
                flat = torch.frombuffer(view, dtype=torch.uint8)
                missing = []
                for row in table:
                    src = tensors.get(row["name"])
                    if src is None:
                        missing.append(row["name"])
                        continue
                    dtype = dtype_from_name(row["dtype"])
                    if src.dtype != dtype or list(src.shape) != list(row["shape"]):
                        raise ValueError(
                            f"{row['name']}: pushed {src.dtype} {list(src.shape)}, the cache "
                            f"holds {dtype} {row['shape']}"
                        )
                    dst = flat[row["offset"]: row["offset"] + row["nbytes"]]
                    dst.view(dtype).view(src.shape).copy_(src.detach().to("cpu"))
                    del dst
                del flat
                if missing:
                    raise ValueError(f"push lacks {len(missing)} tensors: {missing[:8]}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def push_update(
    pushes: Mapping[str | os.PathLike, Mapping[str, torch.Tensor]], *, force: bool = False,
    pause_deadline_s: float = 30.0, timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Push new tensors to each rank's socket and switch all of them at one barrier.

    `pushes` maps a daemon socket to that rank's full state dict (names, dtypes, shapes as
    cached): an update whose bytes come from a process on the node (an RL trainer), not from
    a checkpoint on disk. Raises `UpdateError` (nothing switched, or the cache marked broken).
    """
    return update_group(list(pushes), pushes=pushes, force=force,
                        pause_deadline_s=pause_deadline_s, timeout_s=timeout_s)


def _detail(replies: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [r for r in replies if not r.get("ok")]
    out: dict[str, Any] = {}
    for r in bad:
        for key in ("tensors", "engines", "count"):
            if key in r:
                out[key] = r[key]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache update", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="the new revision's safetensors directory")
    p.add_argument("--weight-cache-socket-dir", "--socket-dir", dest="socket_dir", default=None)
    p.add_argument("--socket-path", action="append", default=None,
                   help="a daemon socket to update (repeatable; default: every main socket "
                        "in the socket directory)")
    p.add_argument("--role", choices=(*ROLES, "main"), default=ROLE_TARGET,
                   help="which daemons: the target model's or the draft's")
    p.add_argument("--force", action="store_true",
                   help="update even while zero_copy engines that cannot pause are attached "
                        "(they see the bytes change under running work)")
    p.add_argument("--pause-deadline-s", type=float, default=30.0,
                   help="how long engines may take to pause before the update is called off")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="per-daemon request deadline (staging a large shard takes a while)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        open_checkpoint(args.model)
        if args.socket_path:
            sockets = [Path(p) for p in args.socket_path]
        else:
            sockets = discover(resolve_socket_dir(args.socket_dir), args.role)
    except (CheckpointError, SecurityError, OSError) as exc:
        return _fail("bad_input", str(exc), EXIT_BAD_INPUT)
    try:
        result = update_group(sockets, model=str(Path(args.model).resolve()), force=args.force,
                              pause_deadline_s=args.pause_deadline_s, timeout_s=args.timeout_s)
    except UpdateError as exc:
        return _fail(exc.code, str(exc), EXIT_UPDATE_FAILED, broken=exc.broken, **exc.detail)
    print(json.dumps(result), flush=True)
    return EXIT_OK


def _fail(error: str, message: str, code: int, **extra: Any) -> int:
    """One JSON line on stdout (for scripts) and the same message as one line on stderr."""
    print(json.dumps({"error": error, "message": message, "broken": False, **extra}), flush=True)
    print(f"weightcache update: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
