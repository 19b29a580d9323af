"""Fixtures of the native daemon tests: tiny checkpoints and real `weightcache preload` runs."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from weightcache.testing.checkpoints import TINY, write_llama_checkpoint
from weightcache.testing.processes import Preload


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama-shaped checkpoint: 2 files + index, tied embeddings, bf16."""
    return write_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY, files=2)


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    return private_dir(tmp_path / "sockets")


@pytest.fixture
def preload() -> Iterator[Callable[..., Preload]]:
    """Start `weightcache preload` children; every one is stopped at teardown."""
    started: list[Preload] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Preload:
        p = Preload(list(args), env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def served(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """One TP=1 daemon shared by the tests that leave it as they found it: (dir, READY info)."""
    sockets = private_dir(tmp_path_factory.mktemp("served") / "sockets")
    p = Preload(["--model", str(ckpt), "--weight-cache-socket-dir", str(sockets)])
    try:
        yield sockets, p.wait_ready(120)
    finally:
        p.stop()


def wait_until(predicate: Callable[[], Any], seconds: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `seconds` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def raw_connect(path: str | Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def as_uid(uid: int, fn: Callable[[], Any]) -> Any:
    """Run `fn` in a forked child whose effective uid (what SO_PEERCRED reports) is `uid`.

    The child keeps root's filesystem uid, so socket file permissions let it through: a
    refusal must come from the daemon's own peer check. `fn`'s JSON-able result comes back.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, only what fn does
        code = 1
        try:
            os.close(r)
            os.seteuid(uid)
            ctypes.CDLL(None).setfsuid(0)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as exc:
            os.write(w, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)
