"""The two requests the agent sends to vLLM weight cache daemons: `get_memory` and `watch`.

vLLM's daemon socket (vllm/model_executor/model_loader/weight_cache/protocol.py) frames
every message as an 8-byte big-endian length followed by a pickle. The agent must speak
that format to read readiness and cached bytes, but it never runs `pickle.loads` on what
comes back: replies are decoded with `SafeUnpickler`, which refuses every global lookup.
Pickle can only call code it first imports through `find_class` (GLOBAL, STACK_GLOBAL,
INST, OBJ and the extension-registry opcodes all go through it), so with that closed a reply
can only build dicts, lists, tuples, sets, strings, bytes, numbers, booleans and None. A
daemon reply to these two requests never contains anything else: `get_memory` answers
`{"status": "ok", "memory_bytes": int}`, `watch` answers `{"status": "ok"}` and then holds
the connection open until the daemon exits. Replies are also bounded to `MAX_REPLY_BYTES`.

Bounded bytes do not bound work: pickle's memo lets 4 KB describe a list that refers to
itself twice at every level, 2**1000 nodes when walked, and formatting it (`repr`, an
f-string) never ends. So a decoded reply is walked once with a budget (`check_plain`:
MAX_NODES visits, MAX_DEPTH levels, shared references counted every time) before anything
reads it, and only a `str` message, cut to MAX_MESSAGE characters, is ever formatted.

Requests go only to sockets that `socket_is_ours` accepts (our uid, our private directory,
no symlinks), over the checked connect of weightcache.native.shared.connection (the peer's uid
by SO_PEERCRED as it connects). The request bytes are constant pickles of plain dicts built here.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import socket
import struct
import time
from typing import Any

from weightcache.errors import ProjectError
from weightcache.native.shared.connection import connect
from weightcache.native.shared.errors import WeightCacheError

_LEN = struct.Struct("!Q")
MAX_REPLY_BYTES = 64 * 1024
MAX_NODES = 10_000
MAX_DEPTH = 32
MAX_MESSAGE = 200
_SCALARS = (str, bytes, int, float, bool, type(None))
SOCKET_NAME = "vllm_weight_cache_{gpu_id}{suffix}.sock"
# Built once from literals: protocol 4 is what every supported Python can read.
_REQUESTS = {
    cmd: pickle.dumps({"cmd": cmd}, protocol=4) for cmd in ("get_memory", "watch")
}


class ProbeError(ProjectError):
    """The socket did not give a well-formed answer."""


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves no global name, so it cannot construct or call anything."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent id")


def safe_loads(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def check_plain(value: Any) -> None:
    """Raise ProbeError unless `value` is plain data within MAX_NODES and MAX_DEPTH.

    Iterative, and every visit counts, so a structure of shared references costs at most
    MAX_NODES steps however large it would be when walked."""
    budget = MAX_NODES
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise ProbeError(f"reply has more than {MAX_NODES} values (refusing to walk it)")
        if depth > MAX_DEPTH:
            raise ProbeError(f"reply is nested deeper than {MAX_DEPTH}")
        if isinstance(item, _SCALARS):
            continue
        if isinstance(item, dict):
            for k, v in item.items():
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((v, depth + 1) for v in item)
        else:
            raise ProbeError(f"reply holds a {type(item).__name__}")


def _message(reply: dict[str, Any]) -> str:
    msg = reply.get("message", "")
    if not isinstance(msg, str):
        return f"<{type(msg).__name__}>"
    return msg if len(msg) <= MAX_MESSAGE else msg[:MAX_MESSAGE] + "..."


def safe_hash_hex(data: bytes) -> str:
    """vLLM's `safe_hash(data)` (vllm/utils/hashing.py) as hex: md5 with
    `usedforsecurity=True`, sha256 where the host refuses that (FIPS mode raises ValueError,
    or `UnsupportedDigestmodError` from OpenSSL). Asking for md5 with
    `usedforsecurity=False` would succeed on such a host and name other sockets than vLLM's.
    """
    try:
        return hashlib.md5(data, usedforsecurity=True).hexdigest()
    except ValueError:  # UnsupportedDigestmodError is a ValueError too
        return hashlib.sha256(data).hexdigest()


def socket_path(socket_dir: str, gpu_uuid: str, *, draft: bool = False) -> str:
    """The path vLLM's `get_socket_path` derives from a GPU UUID (`_draft` for drafts)."""
    gpu_id = safe_hash_hex(gpu_uuid.encode())
    name = SOCKET_NAME.format(gpu_id=gpu_id, suffix="_draft" if draft else "")
    return os.path.join(socket_dir, name)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProbeError("timed out waiting for the daemon's reply")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProbeError("daemon closed the connection mid-reply")
        buf.extend(chunk)
    return bytes(buf)


def _exchange(path: str, cmd: str, timeout: float) -> tuple[socket.socket, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    try:  # the checked connect every daemon client uses (directory, file, SO_PEERCRED)
        sock = connect(path, timeout=timeout)
    except WeightCacheError as exc:
        raise ProbeError(f"{cmd} on {path}: {exc}") from exc
    try:
        payload = _REQUESTS[cmd]
        sock.sendall(_LEN.pack(len(payload)) + payload)
        (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
        if length > MAX_REPLY_BYTES:
            raise ProbeError(f"reply of {length} bytes exceeds the {MAX_REPLY_BYTES} byte bound")
        try:
            reply = safe_loads(_recv_exact(sock, length, deadline))
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as exc:
            raise ProbeError(f"undecodable reply: {exc}") from exc
        if not isinstance(reply, dict):
            raise ProbeError(f"reply is a {type(reply).__name__}, not a dict")
        check_plain(reply)
        status = reply.get("status")
        if status != "ok":
            shown = repr(status)[:MAX_MESSAGE] if isinstance(status, _SCALARS) else "<value>"
            raise ProbeError(f"daemon answered {shown}: {_message(reply)}")
        return sock, reply
    except OSError as exc:
        sock.close()
        raise ProbeError(f"{cmd} on {path}: {exc}") from exc
    except BaseException:
        sock.close()
        raise


def get_memory(path: str, timeout: float = 5.0) -> int:
    """Bytes the daemon's engines would map (`memory_bytes`)."""
    sock, reply = _exchange(path, "get_memory", timeout)
    sock.close()
    value = reply.get("memory_bytes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeError(f"get_memory returned a bad memory_bytes {value!r}")
    return value


def watch(path: str, timeout: float = 5.0) -> socket.socket:
    """An open watch connection; it becomes readable (EOF) when the daemon exits."""
    sock, _ = _exchange(path, "watch", timeout)
    sock.setblocking(False)
    return sock
