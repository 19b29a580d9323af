"""Start-up, readiness, failure and shutdown of `weightcache preload`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from weightcache.native.daemon.config import BIND_DELAY_ENV
from weightcache.native.engine.attach import DaemonUnavailableError, attach, query
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.native.shared.security import SocketLock

from .conftest import raw_connect, wait_until


def http_status(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_ranks_and_removes_sockets_and_locks(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--tensor-parallel-size", "2",
                "--weight-cache-socket-dir", str(sock_dir), "--weight-cache-health-port", "0")
    health = json.loads(p.proc.stdout.readline().removeprefix("HEALTH "))["url"]
    ready = p.wait_ready(120)
    assert http_status(health) == (200, http_status(health)[1])
    assert http_status(health)[1]["ready"] is True
    names = sorted(os.listdir(sock_dir))
    assert names == sorted([f"{cpu_identity(i)}.sock" for i in (0, 1)]
                           + [f"{cpu_identity(i)}.sock.lock" for i in (0, 1)])
    assert all(os.stat(sock_dir / n).st_mode & 0o777 == 0o600 for n in names)
    watcher = raw_connect(ready["sockets"][1])
    proto.send_frame(watcher, {"cmd": "watch"})
    assert proto.recv_frame(watcher)[0]["watching"]
    watcher.settimeout(30)

    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(30) == 0
    assert watcher.recv(1) == b""  # the watch closes when the daemon exits
    watcher.close()
    assert os.listdir(sock_dir) == []
    assert wait_until(lambda: not any(pid_alive(pid) for pid in ready["pids"]), 10)


def test_not_ready_while_loading_never_a_partial_table(ckpt, sock_dir, preload, monkeypatch):
    # Waiting for the loading daemon off (engine/loading.py): what a client sees meanwhile.
    monkeypatch.setenv("WEIGHTCACHE_LOADING_WAIT_S", "0")
    env = {**os.environ, BIND_DELAY_ENV: "4"}
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                "--weight-cache-health-port", "0", env=env)
    health = json.loads(p.proc.stdout.readline().removeprefix("HEALTH "))["url"]
    path = socket_path(sock_dir, cpu_identity(0))
    wait_until(Path(f"{path}.lock").exists, 60)
    # Loading: the lock is held, the socket is not bound, health says 503 per rank.
    assert not path.exists()
    code, body = http_status(health)
    assert code == 503 and body["ranks"][0]["state"] == "loading"
    with pytest.raises(DaemonUnavailableError, match="no daemon socket"):
        attach(ckpt, socket_dir=sock_dir, fallback=False)
    res = attach(ckpt, socket_dir=sock_dir)
    assert res.source == "disk" and res.reason.startswith("unavailable")
    p.wait_ready(60)
    assert http_status(health)[0] == 200
    assert attach(ckpt, socket_dir=sock_dir, fallback=False).source == "cache"


def test_second_daemon_on_the_same_socket_fails_fast(served, ckpt, preload):
    sockets, ready = served
    t0 = time.monotonic()
    second = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sockets))
    assert second.proc.wait(60) == 3
    assert time.monotonic() - t0 < 30
    err = second.proc.stderr.read()
    assert "rank 0 exited with code 3" in err
    assert f"already serves {ready['sockets'][0]}" in err
    assert query(ready["sockets"][0], "hello")["ready"]  # the first one is untouched


def test_rank_dying_at_start_up_stops_the_others(ckpt, sock_dir, preload):
    lock = SocketLock(socket_path(sock_dir, cpu_identity(1)))
    lock.acquire()  # rank 1's socket is taken: that rank exits 3 during start-up
    try:
        p = preload("--model", str(ckpt), "--tensor-parallel-size", "2",
                    "--weight-cache-socket-dir", str(sock_dir))
        assert p.proc.wait(60) == 3
        assert "READY" not in p.proc.stdout.read()
        assert "rank 1 exited with code 3 during start-up" in p.proc.stderr.read()
        assert not socket_path(sock_dir, cpu_identity(0)).exists()
        assert not Path(f"{socket_path(sock_dir, cpu_identity(0))}.lock").exists()
    finally:
        lock.release()


def test_exit_with_parent_stops_everything_when_the_supervisor_dies(ckpt, sock_dir):
    script = (
        f"{sys.executable} -m weightcache.cli preload --model {ckpt} --exit-with-parent"
        f" --weight-cache-socket-dir {sock_dir} & wait"
    )
    sup = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = sup.stdout.readline()
        assert line.startswith("READY ")
        pids = json.loads(line[6:])["pids"]
        sup.kill()  # the supervisor dies without any chance to clean up
        sup.wait()
        assert wait_until(lambda: os.listdir(sock_dir) == [] and not any(map(pid_alive, pids)),
                          30)
    finally:
        if sup.poll() is None:
            sup.kill()
        sup.stdout.close()
