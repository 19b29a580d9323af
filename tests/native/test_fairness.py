"""Fairness and bounded state of a real daemon rank under hostile or bursty clients.

Real daemon processes and sockets; the hostile clients run in a separate process, so the
per-process limits apply to them and not to the engines we attach as.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from weightcache.native.engine.attach import attach, query
from weightcache.native.shared import limits
from weightcache.native.shared import protocol as proto

from .conftest import raw_connect


def _burst(args: tuple[str, str, int]) -> list[str]:
    ckpt, sockets, n = args
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(
            lambda _: attach(ckpt, socket_dir=sockets, fallback=True).source, range(n)))
    return results


def test_200_concurrent_attaches_all_hit(served, ckpt):
    """8 processes x 25 threads attach at once: every one is served from the cache (no
    `busy`, no EAGAIN on connect: the backlog queues them)."""
    sockets, _ = served
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(8) as pool:
        per = pool.map(_burst, [(str(ckpt), str(sockets), 25)] * 8)
    sources = [s for chunk in per for s in chunk]
    assert len(sources) == 200 and set(sources) == {"cache"}


HOSTILE = textwrap.dedent("""
    import socket, sys, time
    path, idle, watchers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    held = []
    for _ in range(idle):  # connect and trickle one byte, then nothing
        s = socket.socket(socket.AF_UNIX); s.connect(path); s.send(b"\\0"); held.append(s)
    import msgpack, struct
    frame = msgpack.packb({"cmd": "watch"})
    ok = 0
    for _ in range(watchers):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            s.sendall(struct.pack(">I", len(frame)) + frame)
            s.settimeout(5)
            n = struct.unpack(">I", s.recv(4))[0]
            reply = msgpack.unpackb(s.recv(n))
        except (OSError, struct.error):
            continue  # refused and closed by the daemon
        ok += bool(reply.get("ok"))
        held.append(s)
    print(ok, flush=True)
    sys.stdin.read()
""")


def test_idle_and_watch_connections_cannot_starve_attaches(served, ckpt):
    sockets, ready = served
    path = ready["sockets"][0]
    hog = subprocess.Popen([sys.executable, "-c", HOSTILE, path, "16", "64"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        watching = int(hog.stdout.readline())
        # One process gets its share of watch slots, no more; the rest were told `busy`.
        assert watching == limits.WATCH_PER_PID
        for _ in range(5):
            assert attach(ckpt, socket_dir=sockets, fallback=False).source == "cache"
        assert query(path, "stats")["watchers"] >= limits.WATCH_PER_PID
    finally:
        hog.stdin.close()
        hog.wait(10)


def test_a_trickled_request_is_cut_at_its_deadline(ckpt, sock_dir, preload):
    """One byte a second never completes a request: the connection is closed once the
    whole-request deadline (here 1 s) passes, however often bytes arrive."""
    ready = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                    env={**os.environ, limits.DEADLINE_ENV: "1"}).wait_ready(120)
    with raw_connect(ready["sockets"][0], timeout=30) as s:
        s.sendall(b"\0\0\0\x20")  # announces 32 bytes, sends them one by one
        sent = 0
        s.settimeout(0.3)
        while True:
            try:
                data = s.recv(1 << 16)
                break
            except TimeoutError:
                try:
                    s.send(b"\x80")
                except OSError:
                    data = b""
                    break
                sent += 1
                assert sent < 60, "the daemon kept a trickling connection"
            except ConnectionResetError:
                data = b""
                break
        assert data == b"" and sent < 31


@pytest.mark.parametrize("request_", [
    {"cmd": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},  # noqa: E501
    {"cmd": "x" * 10_000},
    {"cmd": "get_state", "fingerprint": {f"k{i}": i for i in range(5000)}},
    {"cmd": "get_state", "fingerprint": {"checkpoint": "x" * 10_000}},
    {"cmd": "get_state", "fingerprint": {"content": {"chunk": 1, "files": {
        f"f{i}": {} for i in range(5000)}}}},
    {"cmd": "get_state", "fingerprint": {}, "mode": {"a": 1}},
])
def test_hostile_requests_get_an_error_reply_and_state_stays_bounded(served, request_):
    _, ready = served
    path = ready["sockets"][0]
    # {"cmd": [[[...]]]} 100,000 deep, written by hand (msgpack's packer stops at 512).
    deep = b"\x81\xa3cmd" + b"\x91" * 100_000 + b"\x90"
    nested = struct.pack(">I", len(deep)) + deep
    for req in (request_, nested):
        with raw_connect(path) as s:
            try:
                if isinstance(req, bytes):
                    s.sendall(req)
                else:
                    proto.send_frame(s, req)
                reply, _ = proto.recv_frame(s)
            except (proto.ProtocolError, OSError):
                continue  # refused at the frame level (too deep for msgpack): also fine
            assert reply["ok"] is False and reply["error"] in proto.ERROR_CODES
            if reply["error"] == proto.E_BAD_FRAME:
                continue  # not a frame we can read: the connection is closed after the reply
            # The connection survives a bad request.
            proto.send_frame(s, {"cmd": "hello"})
            assert proto.recv_frame(s)[0]["ok"] is True
    stats = query(path, "stats")
    assert set(stats["mismatches"]) <= {"checkpoint", "tp_size", "tp_rank", "dtype",
                                        "shard_rules", "aliases", "runtime_version", "content"}
    assert set(stats["requests"]) <= {*proto.COMMANDS, "invalid", "unknown", "connect"}


def test_nothing_but_whole_frames_hold_a_slot(served):
    """Sanity of the accounting: after hostile connections close, the slots come back."""
    _, ready = served
    path = ready["sockets"][0]
    socks = [socket.socket(socket.AF_UNIX) for _ in range(limits.PER_PID)]
    for s in socks:
        s.connect(path)
    extra = raw_connect(path)  # one more from this process: told `busy` at once
    reply, _ = proto.recv_frame(extra)
    assert reply["error"] == proto.E_BUSY and "pid" in reply["message"]
    for s in [*socks, extra]:
        s.close()
    deadline = time.monotonic() + 10
    while query(path, "stats")["connections"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert query(path, "hello")["ok"] is True
