"""`weightcache update`: switch every daemon rank of this node to a new revision in place.

The coordinator holds one connection per rank and moves all of them through the phases of
`native/update.py` together, so the ranks of a group switch at one barrier or none does:

  1. stage on every rank (in parallel; engines keep serving);   any refusal -> abort all
  2. pause on every rank (begin; wait for the engines' acks);     any refusal -> abort all
  3. write on every rank (in parallel);                           any failure -> abort all,
                                                                  which marks written ranks broken
  4. finish on every rank (new generation, `finish` announced).

Before step 3 an abort leaves every rank serving the old generation. Prints one JSON line:
generation, bytes, seconds staged, seconds paused, engines paused. Exit codes: 0 updated,
1 the update failed or was refused (the JSON has "error" and "message"), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class UpdateFailed(RuntimeError):
    """The group did not switch (or, with `broken`, could not be kept whole)."""

    def __init__(self, code: str, message: str, *, broken: bool = False,
                 detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.broken, self.detail = code, broken, detail or {}


def discover(socket_dir: Path, role: str = "main") -> list[Path]:
    """Every daemon socket of this node in `socket_dir` (one per rank and role)."""
    suffix = ".sock" if role == "main" else f"_{role}.sock"
    found = []
    for path in sorted(socket_dir.iterdir()):
        if not path.name.endswith(suffix) or (role == "main" and "_" in path.name):
            continue
        if path.is_socket() and not path.is_symlink():
            found.append(path)
    return found


class _Rank:
    def __init__(self, path: Path, timeout_s: float) -> None:
        from .client import connect

        self.path = path
        self.sock: socket.socket = connect(path, timeout=timeout_s)
        self.update_id: str | None = None
        self.staged: dict[str, Any] = {}
        self.written = False

    def call(self, cmd: str, fds: list[int] | None = None, **fields: Any) -> dict[str, Any]:
        from . import protocol as proto
        from .client import request

        if fds:
            try:
                proto.send_frame(self.sock, {"cmd": cmd, **fields}, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            reply, _ = proto.recv_frame(self.sock)
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
    from .client import WeightCacheError
    from .updates import arena_image

    if not sockets:
        raise UpdateFailed("no_daemons", "no daemon sockets to update")
    ranks: list[_Rank] = []
    try:
        try:
            ranks = [_Rank(Path(p), timeout_s) for p in sockets]
        except WeightCacheError as exc:
            raise UpdateFailed("unavailable", str(exc)) from None
        t0 = time.monotonic()

        def stage(rank: _Rank) -> dict[str, Any]:
            if pushes is None:
                return rank.call("update_stage", source="checkpoint", model=str(model))
            key = next(k for k in pushes if Path(k) == rank.path)
            table = rank.call("get_table")
            if not table.get("ok"):
                return table
            try:
                fd = arena_image(table["tensors"], table["bytes"], pushes[key])
            except ValueError as exc:
                return {"ok": False, "error": "layout_mismatch", "message": str(exc)}
            return rank.call("update_stage", [fd], source="push")

        replies = _all(ranks, stage)
        for reply, rank in zip(replies, ranks, strict=True):
            if reply.get("ok"):
                rank.update_id, rank.staged = reply["update"], reply
        staged_s = time.monotonic() - t0
        if failed := _failed(replies, ranks):
            raise UpdateFailed(*failed, detail=_detail(replies))
        blockers = [b for r in replies for b in r.get("blockers", [])]
        if blockers and not force:
            pids = ", ".join(str(b["pid"]) for b in blockers)
            raise UpdateFailed("unpausable_engine",
                               f"zero_copy engines that cannot pause are attached (pid {pids});"
                               " use --force to update anyway", detail={"engines": blockers})
        t_pause = time.monotonic()
        replies = _all(ranks, lambda r: r.call("update_pause", update=r.update_id, force=force,
                                               deadline_s=pause_deadline_s))
        if failed := _failed(replies, ranks):
            raise UpdateFailed(*failed, detail=_detail(replies))
        paused = sum(int(r.get("paused", 0)) for r in replies)
        forced = sorted({p for r in replies for p in r.get("forced", [])})

        def write(rank: _Rank) -> dict[str, Any]:
            rank.written = True  # whatever happens next, this rank's bytes may have changed
            return rank.call("update_write", update=rank.update_id)

        replies = _all(ranks, write)
        if failed := _failed(replies, ranks):
            raise UpdateFailed(*failed, broken=True)
        write_s = max(float(r.get("seconds", 0)) for r in replies)
        replies = _all(ranks, lambda r: r.call("update_finish", update=r.update_id))
        if failed := _failed(replies, ranks):
            raise UpdateFailed(*failed, broken=True)
        for rank in ranks:
            rank.update_id = None
        paused_s = time.monotonic() - t_pause
        return {
            "generation": max(int(r["generation"]) for r in replies),
            "ranks": len(ranks),
            "bytes": sum(int(r.staged.get("bytes", 0)) for r in ranks),
            "seconds_staged": round(staged_s, 6),
            "seconds_paused": round(paused_s, 6),
            "seconds_write": round(write_s, 6),
            "seconds_total": round(time.monotonic() - t0, 6),
            "engines_paused": paused,
            "forced_engines": forced,
            "identity": replies[0].get("identity"),
            "source": "push" if pushes is not None else str(model),
        }
    except BaseException:
        for rank in ranks:  # nothing switches, or written ranks are marked broken
            if rank.update_id is not None:
                with contextlib.suppress(Exception):
                    rank.call("update_abort", update=rank.update_id)
        raise
    finally:
        for rank in ranks:
            rank.close()


def _detail(replies: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [r for r in replies if not r.get("ok")]
    out: dict[str, Any] = {}
    for r in bad:
        for key in ("tensors", "engines", "count"):
            if key in r:
                out[key] = r[key]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache update", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the new revision's safetensors directory")
    p.add_argument("--weight-cache-socket-dir", "--socket-dir", dest="socket_dir", default=None)
    p.add_argument("--socket-path", action="append", default=None,
                   help="a daemon socket to update (repeatable; default: every main socket "
                        "in the socket directory)")
    p.add_argument("--role", choices=("main", "draft"), default="main")
    p.add_argument("--force", action="store_true",
                   help="update even while zero_copy engines that cannot pause are attached "
                        "(they see the bytes change under running work)")
    p.add_argument("--pause-deadline-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError, open_checkpoint
    from .security import SecurityError, resolve_socket_dir

    try:
        open_checkpoint(args.model)
        if args.socket_path:
            sockets = [Path(p) for p in args.socket_path]
        else:
            sockets = discover(resolve_socket_dir(args.socket_dir), args.role)
    except (CheckpointError, SecurityError, OSError) as exc:
        print(json.dumps({"error": "bad_input", "message": str(exc)}))
        return EXIT_BAD_INPUT
    try:
        result = update_group(sockets, model=str(Path(args.model).resolve()), force=args.force,
                              pause_deadline_s=args.pause_deadline_s, timeout_s=args.timeout_s)
    except UpdateFailed as exc:
        print(json.dumps({"error": exc.code, "message": str(exc), "broken": exc.broken,
                          **exc.detail}))
        return EXIT_FAILED
    print(json.dumps(result), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
