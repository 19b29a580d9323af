"""A rank that stops answering (SIGSTOP) is reported by the launcher's /health within
seconds, and reported serving again once it answers (SIGCONT)."""

from __future__ import annotations

import json
import os
import signal
import time

from weightcache.native.engine.attach import query

from .test_lifecycle import http_status


def wait_for(url: str, code: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got, body = http_status(url)
        if got == code or time.monotonic() > deadline:
            assert got == code, body
            return body
        time.sleep(0.1)


def serving_with_health(ckpt, sock_dir, preload) -> tuple[str, str, int]:
    """A one-rank `weightcache preload` with its /health: (health url, socket, rank pid)."""
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                "--weight-cache-health-port", "0")
    ready = p.wait_ready(120)
    url = json.loads(next(ln for ln in p.lines if ln.startswith("HEALTH "))[7:])["url"]
    wait_for(url, 200)
    sock = ready["sockets"][0]
    return url, sock, query(sock, "hello")["pid"]


def test_a_stopped_rank_is_reported_unresponsive(ckpt, sock_dir, preload):
    url, _, pid = serving_with_health(ckpt, sock_dir, preload)
    os.kill(pid, signal.SIGSTOP)
    try:
        body = wait_for(url, 503)
        assert [r["state"] for r in body["ranks"]] == ["unresponsive"]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [r["state"] for r in wait_for(url, 200)["ranks"]] == ["serving"]
