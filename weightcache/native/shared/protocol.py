"""Wire format of the native daemon's Unix socket (docs/native.md, docs/interfaces.md).

A frame is a 4-byte big-endian length followed by a msgpack map. File descriptors travel as
SCM_RIGHTS ancillary data attached to the frame that announces them with `"fds": n`. There is
no pickle anywhere: a peer can make us decode only maps, lists, strings, numbers and bytes,
and never more than MAX_FRAME bytes or MAX_FDS descriptors per frame.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct
import time
from typing import Any

import msgpack

from weightcache.errors import ProjectError

# 2: get_state answers a `table_digest` (loader.ArenaLayout.digest) instead of the rows, and
# the fingerprint's `checkpoint` hashes the raw header bytes. A v1 peer is refused cleanly
# both ways: hello's protocol (client side), runtime_version in the fingerprint (daemon side).
# 3: `get_plan` ships the daemon's plan to an engine whose plan key matches (plantable.py),
# and `get_table` answers in pages (`start`, `next`). A v2 peer is refused as a v1 one was.
# 4: a copy-mode engine may ask `get_state {claim: "after"}` without its content claim and
# send the claim once its copy has landed (`check_claim`, whose answer is also the after-copy
# check): its hashing overlaps the copy instead of delaying it. A v3 peer is refused as above.
PROTOCOL_VERSION = 4
MAX_FRAME = 16 * 1024 * 1024
MAX_FDS = 16
_HEADER = struct.Struct(">I")

# Error codes carried in `{"ok": false, "error": code, "message": str}`.
E_BAD_FRAME = "bad_frame"
E_FRAME_TOO_LARGE = "frame_too_large"
E_BAD_REQUEST = "bad_request"
E_UNKNOWN_COMMAND = "unknown_command"
E_NOT_READY = "not_ready"
E_RELEASED = "released"
E_FINGERPRINT_MISMATCH = "fingerprint_mismatch"
E_TRANSPORT_UNAVAILABLE = "transport_unavailable"
E_PERMISSION_DENIED = "permission_denied"
E_BUSY = "busy"
E_INTERNAL = "internal"
E_NO_PLAN = "no_plan"  # get_plan: this rank ships no plan (the engine plans itself)
# In-place updates (native/daemon/updater.py).
E_LAYOUT_MISMATCH = "layout_mismatch"
E_UPDATE_STATE = "update_state"
E_PAUSE_TIMEOUT = "pause_timeout"
E_UNPAUSABLE = "unpausable_engine"
E_BROKEN = "broken"
E_ROLLED_BACK = "rolled_back"  # the write failed and the previous bytes were restored
E_NO_ROLLBACK = "no_rollback"  # a rollback copy was required and host memory does not allow it
ERROR_CODES = frozenset(
    {
        E_BAD_FRAME,
        E_FRAME_TOO_LARGE,
        E_BAD_REQUEST,
        E_UNKNOWN_COMMAND,
        E_NOT_READY,
        E_RELEASED,
        E_FINGERPRINT_MISMATCH,
        E_TRANSPORT_UNAVAILABLE,
        E_PERMISSION_DENIED,
        E_BUSY,
        E_INTERNAL,
        E_NO_PLAN,
        E_LAYOUT_MISMATCH,
        E_UPDATE_STATE,
        E_PAUSE_TIMEOUT,
        E_UNPAUSABLE,
        E_BROKEN,
        E_ROLLED_BACK,
        E_NO_ROLLBACK,
    }
)
COMMANDS = ("hello", "get_plan", "get_state", "check_claim", "get_memory", "release", "watch",
            "stats")
# In-place update commands, handled by native/daemon/updater.py (docs/updates.md).
UPDATE_COMMANDS = (
    "get_table", "update_stage", "update_pause", "update_write", "update_finish", "update_abort"
)
# The only command a client may attach fds to: an RL trainer's pushed arena image (one memfd).
FD_COMMANDS = frozenset({"update_stage"})


class ProtocolError(ProjectError, RuntimeError):
    """The peer sent something that is not a valid frame; the connection must be closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerClosedError(ProtocolError):
    """The peer closed the connection (cleanly, at a frame boundary or not)."""

    def __init__(self, message: str = "peer closed the connection") -> None:
        super().__init__(E_BAD_FRAME, message)


def encode(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, obj: dict[str, Any], fds: list[int] | tuple = ()) -> None:
    """Send one frame; `fds` ride on its first byte and `obj["fds"]` is set to their count."""
    fds = list(fds)
    if fds:
        if len(fds) > MAX_FDS:
            raise ProtocolError(E_BAD_REQUEST, f"at most {MAX_FDS} fds per frame")
        obj = {**obj, "fds": len(fds)}
    data = encode(obj)
    if fds:
        sent = sock.sendmsg(
            [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of this protocol")


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _recv_exact(
    sock: socket.socket, n: int, fds: list[int], *, first: bool, deadline: float | None = None
) -> bytes:
    """Read n bytes; on the first read also collect SCM_RIGHTS fds into `fds`.

    With a `deadline` (time.monotonic()), the whole read must finish by then: each recv
    waits only for what is left, so a peer trickling bytes cannot stretch it (TimeoutError).
    """
    chunks = bytearray()
    while len(chunks) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request deadline passed")
            sock.settimeout(left)
        if first:
            anc_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            data, ancdata, flags, _ = sock.recvmsg(
                n - len(chunks), anc_space, socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(cdata[: len(cdata) - (len(cdata) % got.itemsize)])
                    fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(E_BAD_FRAME, f"more than {MAX_FDS} fds on one frame")
        else:
            data = sock.recv(min(n - len(chunks), 1 << 20))
        if not data:
            if not chunks and first:
                raise PeerClosedError()
            raise PeerClosedError("peer closed the connection mid-frame")
        chunks += data
        first = False
    return bytes(chunks)


def recv_frame(
    sock: socket.socket,
    *,
    accept_fds: bool = False,
    max_frame: int = MAX_FRAME,
    deadline: float | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame. Fds are accepted only when `accept_fds` (else: closed, and an error).

    Raises ProtocolError for oversized, malformed or non-map frames, and when the number of
    fds received differs from the count the frame announces.
    """
    fds: list[int] = []
    try:
        (length,) = struct.unpack(">I", _recv_exact(sock, _HEADER.size, fds, first=True,
                                                     deadline=deadline))
        if length > max_frame:
            raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {length} bytes exceeds {max_frame}")
        payload = (
            _recv_exact(sock, length, fds, first=False, deadline=deadline) if length else b""
        )
        try:
            obj = msgpack.unpackb(
                payload, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_ext
            )
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(E_BAD_FRAME, f"frame is not valid msgpack: {exc}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(E_BAD_FRAME, f"frame must be a map, got {type(obj).__name__}")
        announced = obj.get("fds", 0)
        if fds and not accept_fds:
            raise ProtocolError(E_BAD_FRAME, "this peer does not accept file descriptors")
        if not isinstance(announced, int) or announced != len(fds):
            raise ProtocolError(
                E_BAD_FRAME, f"frame announces {announced!r} fds but carries {len(fds)}"
            )
        return obj, fds
    except BaseException:
        _close_all(fds)
        raise


TABLE_PAGE = 4 << 20  # about how many bytes of rows one `get_table` reply carries


def table_page(rows: list[dict[str, Any]], start: int) -> tuple[list[dict[str, Any]], int | None]:
    """`rows[start:]` up to about TABLE_PAGE bytes of msgpack (at least one row), and where
    the next page starts (None after the last): a table of any size fits the frame limit."""
    end, size = start, 0
    while end < len(rows) and (end == start or size < TABLE_PAGE):
        row = rows[end]
        size += 64 + len(row["name"]) + 10 * (len(row["shape"]) + len(row["stride"]))
        end += 1
    return rows[start:end], end if end < len(rows) else None


def error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": code, "message": message, **extra}


def ok(**fields: Any) -> dict[str, Any]:
    return {"ok": True, **fields}
