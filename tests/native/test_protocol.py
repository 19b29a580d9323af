"""The socket protocol against a live daemon: bad frames, unknown commands, stats, watch."""

from __future__ import annotations

import array
import os
import socket
import struct
import time

import msgpack
import pytest

from weightcache.native.engine.attach import query
from weightcache.native.shared import protocol as proto

from .conftest import raw_connect


def send_raw(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def reply_then_closed(sock: socket.socket) -> dict:
    reply, _ = proto.recv_frame(sock)
    # Closing with unread input makes the kernel send RST instead of FIN: either means closed.
    with pytest.raises((proto.PeerClosedError, ConnectionResetError)):
        proto.recv_frame(sock)
    return reply


@pytest.fixture
def sock_path(served) -> str:
    return served[1]["sockets"][0]


def test_hello_get_memory_stats(sock_path, served):
    hello = query(sock_path, "hello")
    assert hello["ok"] and hello["protocol"] == proto.PROTOCOL_VERSION and hello["ready"]
    assert hello["capabilities"] == ["memfd"] and hello["transport"] == "memfd"
    assert hello["device"]["kind"] == "cpu" and hello["device"]["uuid"].startswith("cpu-")
    assert (hello["rank"], hello["tp_size"], hello["role"]) == (0, 1, "target")
    mem = query(sock_path, "get_memory")
    assert mem["bytes"] == served[1]["bytes"] and mem["tensors"] > 0 and not mem["released"]
    stats = query(sock_path, "stats")
    assert stats["requests"]["hello"]["ok"] >= 1 and stats["ready"] and stats["load_seconds"] > 0
    hist = stats["attach_seconds"]
    assert hist["buckets"][-1] == ["+Inf", hist["count"]]
    assert all(a[1] <= b[1] for a, b in zip(hist["buckets"], hist["buckets"][1:], strict=False))


def test_unknown_command_keeps_connection(sock_path):
    with raw_connect(sock_path) as s:
        proto.send_frame(s, {"cmd": "format_disk"})
        reply, _ = proto.recv_frame(s)
        assert reply == {"ok": False, "error": "unknown_command",
                         "message": "unknown command 'format_disk'"}
        proto.send_frame(s, {"nocmd": 1})
        assert proto.recv_frame(s)[0]["error"] == "bad_request"
        proto.send_frame(s, {"cmd": "hello"})
        assert proto.recv_frame(s)[0]["ok"]


def test_get_state_without_fingerprint_is_a_bad_request(sock_path):
    with raw_connect(sock_path) as s:
        proto.send_frame(s, {"cmd": "get_state", "fingerprint": "yes"})
        reply, fds = proto.recv_frame(s, accept_fds=True)
        assert reply["error"] == "bad_request" and fds == []


def test_a_claim_after_the_state_is_for_copy_mode_only_and_a_bad_claim_is_refused(sock_path):
    """`get_state {claim: "after"}` (protocol 4) only in copy mode and only with no content
    in the fingerprint; `check_claim` refuses a malformed or wrong claim as a content
    mismatch, counted, and no fds ever travel with either refusal."""
    with raw_connect(sock_path) as s:
        for req in ({"fingerprint": {}, "mode": "zero_copy", "claim": "after"},
                    {"fingerprint": {}, "claim": "after"},
                    {"fingerprint": {"content": {}}, "mode": "copy", "claim": "after"},
                    {"fingerprint": {}, "mode": "copy", "claim": "before"}):
            proto.send_frame(s, {"cmd": "get_state", **req})
            reply, fds = proto.recv_frame(s, accept_fds=True)
            assert reply["error"] == "bad_request" and fds == [], req
        # Well formed but from nothing this daemon read: a mismatch on content alone.
        proto.send_frame(s, {"cmd": "get_state", "fingerprint": {}, "mode": "copy",
                             "claim": "after"})
        reply, fds = proto.recv_frame(s, accept_fds=True)
        assert reply["error"] == "fingerprint_mismatch" and "content" not in reply["fields"]
        assert fds == []
        for claim in (None, "x", {"chunk": 1, "hash": "blake3-128", "files": {}}):
            proto.send_frame(s, {"cmd": "check_claim", "claim": claim})
            reply, fds = proto.recv_frame(s, accept_fds=True)
            assert reply["error"] == "fingerprint_mismatch" and reply["fields"] == ["content"]
            assert fds == []
    stats = query(sock_path, "stats")
    assert stats["requests"]["check_claim"] == {"fingerprint_mismatch": 3}
    assert stats["mismatches"]["content"] >= 3


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (struct.pack(">I", proto.MAX_FRAME + 1), "frame_too_large"),
        (struct.pack(">I", 0xFFFFFFFF) + b"x" * 100, "frame_too_large"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_frame"),  # 0xc1 is never valid msgpack
        (struct.pack(">I", 4) + msgpack.packb([1, 2, 3]), "bad_frame"),
        (struct.pack(">I", 1) + msgpack.packb(None), "bad_frame"),
        (proto.encode({"cmd": "hello", "fds": 2}), "bad_frame"),  # announces fds it lacks
    ],
    ids=["oversized", "huge", "not-msgpack", "not-a-map", "nil", "missing-fds"],
)
def test_malformed_frames_get_an_error_and_a_close(sock_path, data, code):
    with raw_connect(sock_path) as s:
        send_raw(s, data)
        reply = reply_then_closed(s)
        assert reply["ok"] is False and reply["error"] == code
    assert query(sock_path, "hello")["ready"]  # the daemon is still serving


def test_truncated_frames_and_abrupt_closes_do_not_hurt(sock_path):
    for data in (b"", b"\x00\x00", struct.pack(">I", 100) + b"partial"):
        s = raw_connect(sock_path)
        send_raw(s, data)
        s.close()
    s = raw_connect(sock_path)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    send_raw(s, struct.pack(">I", 50))
    s.close()  # RST
    assert query(sock_path, "hello")["ready"]


def test_fds_sent_to_the_daemon_are_refused(sock_path):
    r, w = os.pipe()
    try:
        with raw_connect(sock_path) as s:
            data = proto.encode({"cmd": "hello", "fds": 1})
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            reply = reply_then_closed(s)
            assert reply["error"] == "bad_frame"
    finally:
        os.close(r)
        os.close(w)


def test_frame_limits_on_the_sending_side():
    with pytest.raises(proto.ProtocolError) as info:
        proto.encode({"blob": b"x" * (proto.MAX_FRAME + 1)})
    assert info.value.code == "frame_too_large"
    a, b = socket.socketpair()
    with a, b:
        proto.send_frame(a, {"cmd": "x", "n": [1, 2, {"k": b"\x00"}]})
        assert proto.recv_frame(b) == ({"cmd": "x", "n": [1, 2, {"k": b"\x00"}]}, [])
        r, w = os.pipe()
        proto.send_frame(a, {"cmd": "y"}, [r, w])
        got, fds = proto.recv_frame(b, accept_fds=True)
        assert got["fds"] == 2 and len(fds) == 2
        for fd in (r, w, *fds):
            os.close(fd)
        proto.send_frame(a, {"cmd": "z"}, [])
        a.sendall(struct.pack(">I", 64) + b"\x00" * 10)
        a.shutdown(socket.SHUT_WR)
        assert proto.recv_frame(b)[0] == {"cmd": "z"}
        with pytest.raises(proto.PeerClosedError, match="mid-frame"):
            proto.recv_frame(b)


def test_watch_is_held_open_and_counted(sock_path):
    with raw_connect(sock_path) as w:
        proto.send_frame(w, {"cmd": "watch"})
        assert proto.recv_frame(w)[0] == {"ok": True, "watching": True, "rank": 0}
        deadline = time.monotonic() + 5
        while query(sock_path, "stats")["watchers"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert query(sock_path, "stats")["watchers"] == 1
        w.settimeout(0.2)
        with pytest.raises(TimeoutError):
            w.recv(1)  # nothing arrives while the daemon lives
    deadline = time.monotonic() + 5
    while query(sock_path, "stats")["watchers"] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert query(sock_path, "stats")["watchers"] == 0
