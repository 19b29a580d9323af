"""Nobody but the daemon's own uid can answer for a daemon (issue 24, item 3).

The attack: a user who owns the parent of the socket directory renames the directory away,
puts a symlink to a directory of theirs in its place with a listener at the rank's socket
name, and keeps answering while the real rank is stopped (SIGSTOP). Every connection the
product makes to a daemon goes through one checked connect (directory, socket file, the
peer's uid by SO_PEERCRED): the launcher's liveness ping, the node agent's probes, the
coordinator, the update participant and the engine. Here the stranger is a real process that
setuid()s to another uid and answers every frame with a plausible `ok` reply.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from weightcache.agent.runtimes.base import RankSpec
from weightcache.agent.runtimes.native import NativeRuntime
from weightcache.native.shared.connection import connect
from weightcache.native.shared.errors import CacheSecurityError

from .test_liveness import serving_with_health, wait_for

STRANGER = 4242
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

LISTENER = r"""
import os, socket, sys
from weightcache.native.shared import protocol
path, uid, owner = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)  # as root (test dirs are private to root); the file then is `owner`'s
os.chown(path, owner, owner)
os.setgid(uid); os.setuid(uid)
s.listen(64)  # SO_PEERCRED reports the uid of listen(): the stranger's
print("LISTENING", flush=True)
while True:
    c, _ = s.accept()
    try:
        while True:
            protocol.recv_frame(c)
            protocol.send_frame(c, {"ok": True, "pid": os.getpid(), "bytes": 1, "ready": True})
    except Exception:
        c.close()
"""


def stranger(path: Path, owner: int = STRANGER) -> subprocess.Popen:
    """A listener process of uid STRANGER at `path`, the socket file owned by `owner`."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", LISTENER, str(path), str(STRANGER),
                             str(owner)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "LISTENING"
    return proc


def swap_in_stranger(sock_dir: Path, name: str) -> tuple[Path, subprocess.Popen]:
    """The issue's attack: the socket directory renamed away, a symlink to the stranger's
    directory in its place, the stranger listening at the rank's socket name."""
    theirs = sock_dir.parent / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, STRANGER, STRANGER)
    real = sock_dir.with_name(sock_dir.name + ".real")
    sock_dir.rename(real)
    sock_dir.symlink_to(theirs)
    return real, stranger(theirs / name)


def test_the_launcher_does_not_believe_a_stranger_for_a_stopped_rank(ckpt, sock_dir, preload):
    url, sock, pid = serving_with_health(ckpt, sock_dir, preload)
    path = Path(sock)
    real, listener = swap_in_stranger(sock_dir, path.name)
    os.kill(pid, signal.SIGSTOP)
    try:
        # What the old plain connect believed: the stranger answers at the rank's path.
        assert b"pid" in subprocess.run(
            [sys.executable, "-P", "-c", "import socket,sys;from weightcache.native.shared "
             "import protocol as p;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
             "p.send_frame(s,{'cmd':'hello'});print(p.recv_frame(s)[0])", str(path)],
            capture_output=True).stdout
        body = wait_for(url, 503)
        assert [r["state"] for r in body["ranks"]] == ["unresponsive"]
    finally:
        os.kill(pid, signal.SIGCONT)
        listener.kill()
        listener.wait()
        sock_dir.unlink()
        real.rename(sock_dir)
    assert [r["state"] for r in wait_for(url, 200)["ranks"]] == ["serving"]


def test_every_client_checks_the_peer_even_when_the_path_checks_pass(tmp_path):
    """The race the path checks cannot close: directory and socket file look like ours (root
    owns both: the swap happened after they were checked), the process answering is not.
    Only SO_PEERCRED tells, and every client asks it: the agent's probe, liveness and watch,
    and `connect` (the coordinator, the update participant, the engine)."""
    d = tmp_path / "sockets"
    d.mkdir(mode=0o700)
    path = d / "cpu-x-0.sock"
    listener = stranger(path, owner=0)
    try:
        runtime = NativeRuntime.__new__(NativeRuntime)
        runtime.cfg = SimpleNamespace(socket_dir=str(d))
        rank = RankSpec("target", 0, 0, 0, 0, None, str(path))
        assert "uid 4242" in (runtime.liveness(rank, 2.0) or "")
        probe = runtime.probe(rank, 2.0)
        assert not probe.ok and "uid 4242" in (probe.error or "")
        assert runtime.watch(rank, 2.0) is None
        with pytest.raises(CacheSecurityError, match="uid 4242"):
            connect(path, timeout=2.0)
    finally:
        listener.kill()
        listener.wait()


def test_connect_refuses_a_symlinked_socket_directory(tmp_path):
    """Our own listener behind a symlinked directory is refused too: the directory is
    checked before any byte is sent (only the peer check stops a stranger, this stops the
    path being redirected at all)."""
    import socket as so

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    srv = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    srv.bind(str(real / "r.sock"))
    srv.listen(1)
    (tmp_path / "link").symlink_to(real)
    try:
        with pytest.raises(CacheSecurityError, match="symlink"):
            connect(tmp_path / "link" / "r.sock", timeout=1.0)
        connect(real / "r.sock", timeout=1.0).close()
    finally:
        srv.close()
