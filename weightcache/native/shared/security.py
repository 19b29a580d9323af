"""Local isolation of the daemon's sockets: who may reach them and who may answer on them.

The threat is another local user (or a container sharing the socket directory) who plants a
socket or symlink where an engine expects the daemon, or connects to a daemon to read or
release its weights. Both sides therefore check the socket directory and the socket file
(no symlinks, owned by us, not writable by others) and the peer's uid via SO_PEERCRED, and a
per-socket exclusive lock keeps a second daemon from clobbering a live one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from weightcache.errors import ProjectError


class SecurityError(ProjectError, RuntimeError):
    """A path or a peer failed an ownership/permission check."""


class AlreadyRunningError(ProjectError, RuntimeError):
    """Another daemon holds the lock of this socket."""


def default_socket_dir(uid: int | None = None) -> Path:
    """Per-user private directory under the temp dir (created 0700 by the daemon)."""
    uid = os.getuid() if uid is None else uid
    return Path(tempfile.gettempdir()) / f"weightcache-{uid}"


# Client side: uids whose daemon an engine trusts besides its own (comma-separated), for a
# daemon started with --weight-cache-allow-uid for this engine's uid.
ENV_DAEMON_UID = "WEIGHTCACHE_DAEMON_UID"


def trusted_uids() -> set[int]:
    """Our uid plus those named in WEIGHTCACHE_DAEMON_UID (client side only)."""
    uids = {os.getuid()}
    raw = os.environ.get(ENV_DAEMON_UID, "").strip()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not part.isdigit():
            raise SecurityError(f"{ENV_DAEMON_UID}={raw!r} is not a list of uids")
        uids.add(int(part))
    return uids


def _describe_mode(mode: int) -> str:
    return oct(stat.S_IMODE(mode))


def _lstat_ours(
    path: Path, what: str, kind: str, is_kind: Callable[[int], bool],
    owners: set[int] | None = None,
) -> os.stat_result:
    """lstat `path`; refuse a symlink, something other than a `kind`, or a file of a uid not
    in `owners` (default: ours)."""
    owners = {os.getuid()} if owners is None else owners
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no {what}", str(path)) from None
    if stat.S_ISLNK(st.st_mode):
        raise SecurityError(f"{what} {path} is a symlink; refusing to use it")
    if not is_kind(st.st_mode):
        raise SecurityError(f"{what} {path} is not a {kind}")
    if st.st_uid not in owners:
        raise SecurityError(
            f"{what} {path} is owned by uid {st.st_uid}, not by us (uid {os.getuid()})"
        )
    return st


def _check_owned_dir(path: Path, owners: set[int] | None = None) -> os.stat_result:
    return _lstat_ours(path, "socket directory", "directory", stat.S_ISDIR, owners)


def check_dir(path: Path, *, private: bool, owners: set[int] | None = None) -> None:
    """Refuse a symlinked, foreign-owned, or group/world-writable directory.

    `private` (the auto-derived default) additionally refuses any group/world access.
    `owners`: uids the directory may belong to (default: ours).
    """
    st = _check_owned_dir(path, owners)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SecurityError(
            f"socket directory {path} is group- or world-writable ({_describe_mode(st.st_mode)})"
        )
    if private and st.st_mode & 0o077:
        raise SecurityError(
            f"socket directory {path} must be private (0700), is {_describe_mode(st.st_mode)}"
        )


def prepare_socket_dir(path: str | os.PathLike | None, *, make_private: bool = False) -> Path:
    """Create (0700) and check the socket directory; return it.

    The daemons call it for the directory they bind in. The node agent, which owns the
    directory of its group, passes `make_private`: an existing directory of ours (a real
    directory, our uid) is tightened to 0700 before the checks, and the checks then demand it.
    """
    private = path is None or make_private
    target = default_socket_dir() if path is None else Path(path)
    if not target.is_absolute():
        target = Path.cwd() / target
    if not os.path.lexists(target):
        try:
            os.makedirs(target, mode=0o700, exist_ok=False)
        except FileExistsError:
            pass
        else:
            os.chmod(target, 0o700)
    if make_private:
        _check_owned_dir(target)
        os.chmod(target, 0o700)
    check_dir(target, private=private)
    return target


def resolve_socket_dir(path: str | os.PathLike | None) -> Path:
    """Client side: the directory to look in, checked but never created."""
    private = path is None
    target = default_socket_dir() if path is None else Path(path)
    check_dir(target, private=private, owners=trusted_uids())
    return target


def socket_refusal(path: str | os.PathLike, private_dir: str | os.PathLike) -> str | None:
    """Why a client must not talk to `path`, or None when it is our socket in our private dir.

    For callers that poll (the node agent's probes): the same checks as `resolve_socket_dir`
    (private) and `check_socket_file`, answered as a reason instead of an exception.
    """
    path = Path(path)
    if os.path.realpath(path.parent) != os.path.realpath(private_dir):
        return f"{path} is outside the socket directory {private_dir}"
    try:
        check_dir(path.parent, private=True)
        check_socket_file(path)
    except FileNotFoundError:
        return "socket not bound yet"
    except SecurityError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    return None


def check_socket_path(path: Path, owners: set[int] | None = None) -> None:
    """What every connection to a daemon checks before it connects: the socket's directory
    (not a symlink, of a uid in `owners`, writable by no one else) and the socket file.

    A user who may rename the directory away (they own its parent) can still put their own
    listener behind the path between this check and the connect: the peer's credentials,
    checked once connected (`check_peer`), are what refuses them.
    """
    check_dir(path.parent, private=False, owners=owners)
    check_socket_file(path, owners)


def check_socket_file(path: Path, owners: set[int] | None = None) -> None:
    """Refuse a socket path that is a symlink, not a socket, or owned by a uid not in
    `owners` (default: ours)."""
    _lstat_ours(path, "daemon socket", "socket", stat.S_ISSOCK, owners)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def check_peer(sock: socket.socket, allowed_uids: set[int] | None = None) -> tuple[int, int, int]:
    creds = peer_credentials(sock)
    allowed = {os.getuid()} if allowed_uids is None else allowed_uids
    if creds[1] not in allowed:
        raise SecurityError(
            f"peer pid {creds[0]} runs as uid {creds[1]}, allowed: {sorted(allowed)}"
        )
    return creds


class SocketLock:
    """Exclusive, non-blocking lock file `<socket>.lock` next to the socket.

    Holding it is what entitles a daemon to (re)create the socket; it is unlinked on release.
    After locking we check that the path still names the locked inode, so a lock file removed
    by an exiting daemon between our open and flock cannot let two daemons in.
    """

    def __init__(self, socket_path: Path) -> None:
        self.path = Path(f"{socket_path}.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(10):
            fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                    raise SecurityError(f"lock file {self.path} is not a regular file of ours")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise AlreadyRunningError(
                        f"another daemon (pid {holder}) already serves {self.path.with_suffix('')}"
                        f" (lock {self.path} is held)"
                    ) from None
                try:
                    same = os.stat(self.path, follow_symlinks=False).st_ino == st.st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
                return
            except BaseException:
                if self._fd != fd:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                raise
        raise AlreadyRunningError(f"could not lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def check_socket_slot(path: Path) -> None:
    """Daemon side, before loading: the socket path is free or a stale socket of ours.

    Checked again at bind time; checking first means a planted file fails the rank in
    milliseconds with the documented exit code instead of after a full load.
    """
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise SecurityError(f"{path} exists and is not a stale socket of ours; not replacing")


def bind_unix_socket(path: Path, backlog: int = 1024, *, shared: bool = False) -> socket.socket:
    """Bind a listening socket created 0600 (umask applied at bind time, no chmod race).

    `shared` (the daemon allows other uids): 0666, so their engines can connect at all; the
    SO_PEERCRED check against the allowed uids is then what admits or refuses them.
    """
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise SecurityError(f"{path} exists and is not a stale socket of ours; not replacing")
        os.unlink(path)  # stale socket of a dead daemon: we hold the lock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o666 if shared else 0o600)
    sock.listen(backlog)
    return sock
