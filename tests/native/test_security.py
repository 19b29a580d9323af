"""Socket directory, socket file and peer checks, on both the daemon and the client side."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from weightcache.native.daemon import launcher as preload
from weightcache.native.engine.attach import CacheSecurityError, attach, query
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.native.shared.security import SecurityError, check_dir, prepare_socket_dir

from .conftest import as_uid, private_dir, raw_connect

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root to create files owned by others")


def refused_by_daemon(ckpt: Path, sock_dir: Path, caplog) -> str:
    code = preload.main(["--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir)])
    assert code == preload.EXIT_SECURITY
    return caplog.text


def refused_by_client(ckpt: Path, sock_dir: Path) -> str:
    with pytest.raises(CacheSecurityError) as info:
        attach(ckpt, socket_dir=sock_dir, fallback=False)
    res = attach(ckpt, socket_dir=sock_dir, fallback=True)
    assert res.source == "disk" and res.reason.startswith("security")
    return str(info.value)


def test_symlinked_socket_dir_is_refused(served, ckpt, tmp_path, caplog):
    link = tmp_path / "link"
    link.symlink_to(served[0])
    assert "symlink" in refused_by_daemon(ckpt, link, caplog)
    assert "symlink" in refused_by_client(ckpt, link)


def test_world_writable_socket_dir_is_refused(ckpt, tmp_path, caplog):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert "world-writable" in refused_by_daemon(ckpt, d, caplog)
    assert "world-writable" in refused_by_client(ckpt, d)


@needs_root
def test_foreign_owned_socket_dir_is_refused(ckpt, tmp_path, caplog):
    d = private_dir(tmp_path / "theirs")
    os.chown(d, 12345, 12345)
    assert "owned by uid 12345" in refused_by_daemon(ckpt, d, caplog)
    assert "owned by uid 12345" in refused_by_client(ckpt, d)


def test_default_dir_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = prepare_socket_dir(None)
    assert made == tmp_path / f"weightcache-{os.getuid()}"
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    os.chmod(made, 0o750)
    with pytest.raises(SecurityError, match="must be private"):
        prepare_socket_dir(None)
    check_dir(made, private=False)  # an explicit dir may be group-readable, never writable


def test_symlinked_or_foreign_socket_file_is_refused(served, ckpt, tmp_path):
    real = served[1]["sockets"][0]
    d = private_dir(tmp_path / "planted")
    (d / Path(real).name).symlink_to(real)
    assert "symlink" in refused_by_client(ckpt, d)
    if ROOT:
        d2 = private_dir(tmp_path / "foreign")
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(socket_path(d2, cpu_identity(0))))
        s.listen()
        os.chown(socket_path(d2, cpu_identity(0)), 12345, 12345)
        try:
            assert "owned by uid 12345" in refused_by_client(ckpt, d2)
        finally:
            s.close()


@needs_root
def test_peer_uid_is_checked_with_so_peercred(served):
    """A client process of another uid is refused by the daemon itself (SO_PEERCRED).

    The child switches its effective uid (what SO_PEERCRED reports) to nobody's but keeps
    root's filesystem uid, so the socket's file permissions let it through: the refusal
    must come from the daemon's peer check, not from the file system.
    """
    sock = served[1]["sockets"][0]
    nobody = 65534

    def connect() -> dict:
        with raw_connect(sock) as s:  # the daemon speaks first when it refuses
            return proto.recv_frame(s)[0]

    reply = as_uid(nobody, connect)
    assert reply["ok"] is False and reply["error"] == "permission_denied"
    assert f"runs as uid {nobody}, allowed: [0]" in reply["message"]
    stats = query(sock, "stats")
    assert stats["requests"]["connect"]["permission_denied"] >= 1
