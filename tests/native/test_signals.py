"""Stopping `weightcache preload` any way a terminal user does leaves no socket and no lock.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group (POSIX job control,
termios(3) ISIG / VINTR): the launcher and every rank get it at once, and the launcher then
sends its own SIGTERM to ranks that are already cleaning up. `setsid` + `kill -INT -- -PGID`
does exactly that here. Each case checks the socket directory is empty afterwards and every
rank process is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from weightcache.native.daemon.config import BIND_DELAY_ENV
from weightcache.native.shared.identity import cpu_identity, socket_path

from .test_lifecycle import pid_alive

TP = 2


def start(preload, ckpt: Path, sock_dir: Path, delay: float = 0.0):
    env = {**os.environ, BIND_DELAY_ENV: str(delay)} if delay else None
    return preload("--model", str(ckpt), "--tensor-parallel-size", str(TP),
                   "--weight-cache-socket-dir", str(sock_dir), env=env)


def wait_for_locks(sock_dir: Path) -> None:
    locks = [Path(f"{socket_path(sock_dir, cpu_identity(i))}.lock") for i in range(TP)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in locks):
        assert time.monotonic() < deadline, os.listdir(sock_dir)
        time.sleep(0.05)


def rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's children (the ranks), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == launcher_pid:
                out.append(int(entry.name))
    return out


def _where(pids: list[int]) -> str:
    """What each live rank is doing (state, kernel wait channel, threads): for a hang's report."""
    out = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out.append(f"rank {pid}: {fields.get('State', '?').strip()} wchan={wchan} "
                   f"threads={fields.get('Threads', '?').strip()}")
    return "\n".join(out)


def assert_clean(p, sock_dir: Path, pids: list[int]) -> None:
    try:
        code = p.proc.wait(60)
    except subprocess.TimeoutExpired:
        where = _where([p.proc.pid, *pids])
        p.proc.kill()
        err = p.proc.stderr.read()
        pytest.fail(f"the launcher still ran 60 s after the signal\n{where}\n{err}")
    err = p.proc.stderr.read()
    deadline = time.monotonic() + 30
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(pid_alive, pids)), err
    assert os.listdir(sock_dir) == [], f"{os.listdir(sock_dir)}\n{err}"
    assert "Traceback" not in err, err
    assert code == 0, err


@pytest.mark.parametrize("target", ["group", "launcher"])
@pytest.mark.parametrize("phase", ["serving", "loading"])
def test_sigint_leaves_no_sockets_or_locks(ckpt, sock_dir, preload, target, phase):
    p = start(preload, ckpt, sock_dir, delay=30 if phase == "loading" else 0)
    if phase == "serving":
        pids = p.wait_ready(120)["pids"]
    else:
        wait_for_locks(sock_dir)
        pids = rank_pids(p.proc.pid)
        assert len(pids) == TP
    if target == "group":  # Ctrl-C: the whole process group (Preload starts a new session)
        os.killpg(p.proc.pid, signal.SIGINT)
    else:
        p.proc.send_signal(signal.SIGINT)
    assert_clean(p, sock_dir, pids)


def test_sigterm_during_load_leaves_no_sockets_or_locks(ckpt, sock_dir, preload):
    p = start(preload, ckpt, sock_dir, delay=30)
    wait_for_locks(sock_dir)
    pids = rank_pids(p.proc.pid)
    p.proc.send_signal(signal.SIGTERM)
    assert_clean(p, sock_dir, pids)
