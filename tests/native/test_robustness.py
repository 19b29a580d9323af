"""Property tests of the client's contract over hostile input (hypothesis).

The contract (docs/native.md): with fallback on, weights from disk or a WeightCacheError;
with fallback off, a WeightCacheError; never another exception, never a partial or foreign
table. Two surfaces:

- mutated checkpoints, judged against safetensors itself: every file the real `safetensors`
  package refuses (its rules: `read_metadata` and `Metadata::validate` in
  safetensors/src/tensor.rs) we refuse with a CheckpointError naming the file; every file it
  reads we serve with the very bytes it reads;
- a daemon that lies: a proxy in front of a real daemon that rewrites its replies (tables,
  fds, seals, sizes, error shapes) before the client sees them.

Example counts come from the hypothesis profile: "ci" (default, seconds) or "fuzz"
(`make fuzz`, HYPOTHESIS_PROFILE=fuzz).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from weightcache.native.engine.attach import WeightCacheError, attach
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.checkpoint import CheckpointError, open_checkpoint

# Applied per test (not as a global profile, which would change every other hypothesis test
# in the session): HYPOTHESIS_PROFILE=fuzz (`make fuzz`) runs 3,000 examples per property.
FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
PROFILE = settings(
    max_examples=3000 if FUZZ else 60, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8}


# -- checkpoints -----------------------------------------------------------------------------
def _valid_header(tensors: list[tuple[str, str, list[int]]]) -> tuple[dict, int]:
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
                      st.floats(allow_nan=False), st.text(max_size=6))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)


@st.composite
def mutated_file(draw) -> bytes:
    tensors = draw(st.lists(st.tuples(
        st.text("abcxyz._", min_size=1, max_size=6), st.sampled_from(sorted(DTYPES)),
        st.lists(st.integers(0, 4), max_size=3)), min_size=0, max_size=4,
        unique_by=lambda t: t[0]))
    header, size = _valid_header(tensors)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), json_value))
    names = [n for n in header if n != "__metadata__"]
    for _ in range(draw(st.integers(0, 3))):
        if not names:
            break
        name = draw(st.sampled_from(names))
        entry = header[name]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "extra"]))
        if field == "entry":
            header[name] = draw(json_value)
        elif field == "extra" and isinstance(entry, dict):
            entry[draw(st.text(max_size=4))] = draw(json_value)
        elif isinstance(entry, dict):
            entry[field] = draw(st.one_of(
                json_value,
                st.just([0, 2**70]), st.just([2**64, 0]),
                st.lists(st.integers(-(2**66), 2**66), min_size=2, max_size=2),
                st.sampled_from(["F4", "f32", "I128", 3, ["F32"]])))
    text = json.dumps(header)
    kind = draw(st.sampled_from(["plain", "plain", "nested", "badjson", "trailing", "short",
                                 "badlen", "pad", "utf8"]))
    raw = text.encode()
    if kind == "nested":
        depth = draw(st.integers(60, 3000))
        raw = ('{"x":{"dtype":"F32","shape":' + "[" * depth + "]" * depth + "}}").encode()
    elif kind == "badjson":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))] + b"}"
    elif kind == "pad":
        raw += b" " * draw(st.integers(0, 7))
    elif kind == "utf8":
        raw = raw[:-1] + b"\xff}"
    data = bytes(i % 251 for i in range(size))
    if kind == "trailing":
        data += b"\0" * draw(st.integers(1, 9))
    if kind == "short" and data:
        data = data[:-1]
    hlen = len(raw)
    if kind == "badlen":
        hlen = draw(st.sampled_from([0, 7, len(raw) + 1, 10**8 + 1, 2**63]))
    return struct.pack("<Q", hlen) + raw + data


def safetensors_reads(path: Path) -> dict[str, torch.Tensor] | None:
    """What the real safetensors returns for the file, or None when it refuses it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception:  # the oracle refusing, whatever its error type
        return None


@PROFILE
@given(blob=mutated_file())
def test_mutated_checkpoints_follow_safetensors(blob, tmp_path_factory):
    model = tmp_path_factory.mktemp("m")
    path = model / "model.safetensors"
    path.write_bytes(blob)
    theirs = safetensors_reads(path)
    event("safetensors refuses" if theirs is None else "safetensors reads")
    try:
        ckpt = open_checkpoint(model)
    except CheckpointError as exc:
        event("we refuse")
        assert "\n" not in str(exc) and str(model) in str(exc)
        # We may refuse what safetensors reads only for dtypes torch has no use for here.
        assert theirs is None or any(
            t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                            torch.uint8, torch.bool, torch.float64) for t in theirs.values())
        return
    assert theirs is not None, "we accepted a file safetensors refuses"
    assert set(ckpt.tensors) == set(theirs)
    # Served (here: the disk fallback, no daemon) with exactly the bytes safetensors reads.
    res = attach(model, socket_path=model / "no.sock", fallback=True, shard_rules=[])
    assert res.source == "disk"
    for name, tensor in theirs.items():
        assert same_values(res.state_dict[name], tensor), name


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN payloads included); bool by value (a stored 2 reads as True)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fallback", [True, False])
@PROFILE
@given(blob=mutated_file())
def test_attach_raises_only_weightcache_errors(blob, fallback, tmp_path_factory):
    model = tmp_path_factory.mktemp("m")
    (model / "model.safetensors").write_bytes(blob)
    try:
        res = attach(model, socket_path=model / "no.sock", fallback=fallback, shard_rules=[])
    except WeightCacheError:
        return
    assert fallback and res.source == "disk"


# -- a daemon that lies --------------------------------------------------------------------
Mutator = Callable[[str, dict, list[int]], tuple[dict, list[int]]]


class LyingProxy:
    """Forwards each request to the real daemon and lets `mutate` rewrite the reply."""

    def __init__(self, real: str, path: Path, mutate: Mutator) -> None:
        self.real, self.path, self.mutate = real, path, mutate
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(16)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up, \
                    contextlib.suppress(Exception):
                up.connect(self.real)
                conn.settimeout(10)
                while True:
                    req, _ = proto.recv_frame(conn)
                    proto.send_frame(up, req)
                    reply, fds = proto.recv_frame(up, accept_fds=True)
                    reply.pop("fds", None)
                    reply, fds = self.mutate(str(req.get("cmd")), reply, fds)
                    try:
                        _send_raw(conn, reply, fds)
                    finally:
                        for fd in fds:
                            with contextlib.suppress(OSError):
                                os.close(fd)

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _send_raw(conn: socket.socket, reply: Any, fds: list[int]) -> None:
    if isinstance(reply, bytes):  # a raw frame, possibly not even msgpack
        conn.sendall(reply)
        return
    proto.send_frame(conn, reply, fds)


def _unsealed_copy(fds: list[int], truncate: bool) -> list[int]:
    """A memfd with the arena's bytes but no seals; optionally truncated after sending."""
    src = fds[0]
    size = os.fstat(src).st_size
    fd = os.memfd_create("liar", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, os.pread(src, size, 0), 0)
    os.close(src)
    if truncate:
        dup = os.dup(fd)
        threading.Timer(0.05, lambda: (os.ftruncate(dup, 0), os.close(dup))).start()
    return [fd]


def _lies() -> dict[str, Mutator]:
    def on_state(fn):
        return lambda cmd, r, f: fn(r, f) if cmd == "get_state" else (r, f)

    def on_hello(fn):
        return lambda cmd, r, f: fn(r, f) if cmd == "hello" else (r, f)

    def no_digest(r, f):
        r.pop("table_digest", None)
        return r, f

    def other_digest(r, f):  # the digest of a layout one byte off (a partial or shifted table)
        d = r["table_digest"]
        r["table_digest"] = d[:-1] + ("0" if d[-1] != "0" else "1")
        return r, f

    def rows_instead(r, f):  # a protocol-1 reply: the rows, no digest
        r.pop("table_digest", None)
        r["tensors"] = [{"name": "x", "dtype": "uint8", "shape": [1], "stride": [1],
                         "offset": 0, "nbytes": 1}]
        return r, f

    def foreign_fd(r, f):
        for fd in f:
            os.close(fd)
        return r, [os.open("/proc/self/exe", os.O_RDONLY)]

    def pipe_fd(r, f):
        for fd in f:
            os.close(fd)
        rd, wr = os.pipe()
        os.close(wr)
        return r, [rd]

    def no_fd(r, f):
        for fd in f:
            os.close(fd)
        return r, []

    def two_fds(r, f):
        return r, [*f, os.dup(f[0])]

    def small_arena(r, f):
        r["arena"]["nbytes"] = 256
        return r, f

    def huge_frame(r, f):
        for fd in f:
            os.close(fd)
        return struct.pack(">I", proto.MAX_FRAME + 1) + b"\0" * 64, []

    def not_msgpack(r, f):
        return struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1", f

    return {
        "no table digest": on_state(no_digest),
        "another table's digest": on_state(other_digest),
        "rows instead of a digest": on_state(rows_instead),
        "digest of the wrong type": on_state(lambda r, f: (
            {**r, "table_digest": r["table_digest"].encode()}, f)),
        "hello of protocol 1": on_hello(lambda r, f: ({**r, "protocol": 1}, f)),
        "foreign fd": on_state(foreign_fd),
        "pipe fd": on_state(pipe_fd),
        "no fd": on_state(no_fd),
        "two fds": on_state(two_fds),
        "unsealed memfd": on_state(lambda r, f: (r, _unsealed_copy(f, truncate=False))),
        "unsealed memfd truncated after sending": on_state(
            lambda r, f: (r, _unsealed_copy(f, truncate=True))),
        "arena smaller than the layout": on_state(small_arena),
        "unknown transport": on_state(lambda r, f: ({**r, "arena": {"transport": 7}}, f)),
        "huge reply": on_state(huge_frame),
        "not msgpack": on_state(not_msgpack),
        "error with odd fields": on_state(lambda r, f: ({"ok": False, "error": [1],
                                                         "message": {"a": 1}, "fields": 5}, f)),
        "hello device is a list": on_hello(lambda r, f: ({**r, "device": [1, 2]}, f)),
        "hello rank is text": on_hello(lambda r, f: ({**r, "rank": "0"}, f)),
        "hello not a map reply": on_hello(lambda r, f: ({"ok": True, "protocol": [1]}, f)),
    }


@pytest.fixture
def liar(served, tmp_path):
    _, ready = served
    made: list[LyingProxy] = []

    def make(mutate: Mutator) -> Path:
        path = tmp_path / "liar.sock"
        while made:
            made.pop().close()
        made.append(LyingProxy(ready["sockets"][0], path, mutate))
        return path

    yield make
    for p in made:
        p.close()


def open_fds() -> set[tuple[str, str]]:
    """(fd, target) of this process' descriptors (listdir's own, closed by now, is skipped)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


def no_fd_leak(before: set[tuple[str, str]], timeout: float = 5.0) -> bool:
    """True once this process holds no fd it did not hold before (the proxy thread closes
    its side asynchronously, so allow it a moment)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if open_fds() <= before:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("lie", sorted(_lies()))
def test_a_lying_daemon_never_gets_past_the_client(lie, liar, ckpt):
    path = liar(_lies()[lie])
    direct = attach(ckpt, socket_path=path.with_name("none.sock"), fallback=True)
    before = open_fds()
    with pytest.raises(WeightCacheError):
        attach(ckpt, socket_path=path, fallback=False)
    res = attach(ckpt, socket_path=path, fallback=True)
    assert res.source == "disk"
    for name, tensor in direct.state_dict.items():
        assert torch.equal(res.state_dict[name], tensor), name
    assert no_fd_leak(before), open_fds() - before


table_value = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.text(max_size=5),
                        st.lists(st.integers(-3, 2**40), max_size=4), st.booleans(),
                        st.binary(max_size=40))


@PROFILE
@given(at=st.integers(0, 10_000), how=st.sampled_from(["replace", "flip", "cut", "drop"]),
       value=table_value)
def test_any_rewritten_table_is_refused(at, how, value, liar, ckpt):
    """Drawn here, applied in the proxy: the table's digest replaced by any value, one of its
    characters changed, cut short, or dropped."""
    def mutate(cmd, r, f):
        if cmd != "get_state" or not r.get("ok"):
            return r, f
        digest = r["table_digest"]
        i = at % len(digest)
        if how == "drop":
            del r["table_digest"]
        elif how == "cut":
            r["table_digest"] = digest[:i]
        elif how == "flip":
            r["table_digest"] = digest[:i] + ("a" if digest[i] != "a" else "b") + digest[i + 1:]
        else:
            r["table_digest"] = value if value != digest else [value]
        return r, f

    path = liar(mutate)
    with pytest.raises(WeightCacheError):
        attach(ckpt, socket_path=path, fallback=False)
