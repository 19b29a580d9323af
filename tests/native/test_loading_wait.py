"""Scale-up overlaps: an engine that reaches its weights while the daemon still loads its rank
waits for it (bounded) and attaches the moment the socket binds, instead of reading the disk
beside it (engine/loading.py). Real `weightcache preload` processes and Unix sockets; the
daemon's bind is held back with its debug delay to make the loading window long."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from weightcache.native.daemon.config import BIND_DELAY_ENV
from weightcache.native.engine.attach import attach
from weightcache.native.engine.loading import DEFAULT_WAIT_S, wait_bound, wait_while_loading
from weightcache.native.shared.identity import cpu_identity, socket_path


def _lock_held(sock_dir: Path, p) -> Path:
    path = socket_path(sock_dir, cpu_identity(0))
    deadline = time.monotonic() + 60
    while not Path(f"{path}.lock").exists():
        assert time.monotonic() < deadline and p.proc.poll() is None
        time.sleep(0.05)
    assert not path.exists()  # loading: lock held, socket not bound
    return path


def test_attach_waits_for_the_loading_daemon_and_gets_the_cache(ckpt, sock_dir, preload,
                                                                monkeypatch):
    monkeypatch.delenv("WEIGHTCACHE_LOADING_WAIT_S", raising=False)
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BIND_DELAY_ENV: "3"})
    _lock_held(sock_dir, p)
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)  # old code: DaemonLoadingError
    assert res.source == "cache" and res.reason is None
    assert p.proc.poll() is None


def test_past_the_bound_the_engine_loads_from_disk(ckpt, sock_dir, preload, monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_LOADING_WAIT_S", "0.5")
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BIND_DELAY_ENV: "30"})
    path = _lock_held(sock_dir, p)
    res = attach(ckpt, socket_dir=sock_dir)
    assert res.source == "disk" and "a daemon is loading" in res.reason
    assert wait_while_loading(path, 0.2)[0] is False


def test_a_dead_loader_ends_the_wait_at_once(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BIND_DELAY_ENV: "30"})
    path = _lock_held(sock_dir, p)
    p.stop()
    bound, waited = wait_while_loading(path, 60)
    assert bound is False and waited < 30  # not the bound: the lock's holder is gone


def test_wait_bound_from_the_environment(monkeypatch):
    monkeypatch.delenv("WEIGHTCACHE_LOADING_WAIT_S", raising=False)
    assert wait_bound() == DEFAULT_WAIT_S
    monkeypatch.setenv("WEIGHTCACHE_LOADING_WAIT_S", "12.5")
    assert wait_bound() == 12.5 and wait_bound(3) == 3
    monkeypatch.setenv("WEIGHTCACHE_LOADING_WAIT_S", "soon")
    with pytest.raises(ValueError, match="WEIGHTCACHE_LOADING_WAIT_S"):
        wait_bound()
