"""Isolation proof: daemon and engine as two pods on one node would see each other.

Each side runs under `unshare --kill-child` in its own PID namespace (both PID 1: equal
PIDs), and the engine also in its own IPC and mount namespaces with a private /dev/shm. The
VMM path must attach there; the legacy CUDA IPC path must fail with the client's clear error,
not a CUDA crash. `test_legacy_ipc_matrix` then asks the driver itself (client preflight off)
which pod settings legacy IPC really needs, e.g. whether a hostPath at /dev/shm in both pods
can replace hostIPC, and writes the answers to $WEIGHTCACHE_ISOLATION_REPORT (JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import can_unshare, run_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not can_unshare(), reason="needs root and util-linux unshare"),
]


def ns(*, pid: bool = True, ipc: bool = False, shm: str | None = None, pid1: bool = True):
    """Command prefix running the rest in new namespaces, as a pod without host* settings.

    shm: None keeps the host /dev/shm (hostIPC-like), "private" mounts a fresh tmpfs (a pod's
    own /dev/shm), any other value bind-mounts that host directory (a hostPath volume).
    pid1: the command becomes PID 1 of its namespace (else PID 2, under a shell).
    """
    cmd = ["unshare", "--fork", "--kill-child", "--mount"]
    if pid:
        cmd += ["--pid", "--mount-proc"]
    if ipc:
        cmd += ["--ipc"]
    setup = ""
    if shm == "private":
        setup = "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
    elif shm:
        setup = f"mount --bind {shm} /dev/shm && "
    run = 'exec "$@"' if pid1 else '"$@"; rc=$?; exit $rc'
    return [*cmd, "--", "sh", "-c", setup + run, "ns"]


POD = {"pid": True, "ipc": True, "shm": "private"}  # a pod with no host* settings at all


def test_vmm_attaches_across_namespaces_with_equal_pids(daemon_factory, medium_model):
    daemon = daemon_factory(medium_model, "cuda_vmm", prefix=ns(pid=True))
    assert daemon.info["pid"] == 1
    code, report = run_probe(medium_model, daemon.socket, prefix=ns(**POD))
    assert code == 0, report
    assert report["pid"] == 1 and report["verified"] is True
    assert report["free_delta"] < daemon.info["bytes"] // 4


@pytest.mark.parametrize("preflight", ["1", "0"])
def test_legacy_ipc_fails_with_a_clear_error(daemon_factory, medium_model, preflight):
    daemon = daemon_factory(medium_model, "cuda_ipc", prefix=ns(pid=True))
    code, report = run_probe(medium_model, daemon.socket, prefix=ns(**POD),
                             env={"WEIGHTCACHE_IPC_PREFLIGHT": preflight})
    assert code == 3, report  # the client's WeightCacheError, not a crash
    assert "legacy CUDA IPC cannot attach" in report["error"]
    assert "cuda_vmm" in report["error"]


SCENARIOS = {
    # name: (daemon namespaces, engine namespaces)
    "hostPID+hostIPC agent, hostIPC engine": (None, {"pid": True}),
    "hostPID+hostIPC agent, engine own IPC + private shm": (None, {"pid": True, "ipc": True,
                                                                   "shm": "private"}),
    "hostPath shm in both, own PID+IPC, distinct PIDs": (
        {"pid": True, "ipc": True, "shm": "HOSTPATH"},
        {"pid": True, "ipc": True, "shm": "HOSTPATH", "pid1": False},
    ),
    "hostPath shm in both, own PID+IPC, equal PIDs": (
        {"pid": True, "ipc": True, "shm": "HOSTPATH"},
        {"pid": True, "ipc": True, "shm": "HOSTPATH"},
    ),
    "hostPID agent + hostPath shm in both, engine own PID+IPC": (
        {"pid": False, "ipc": True, "shm": "HOSTPATH"},
        {"pid": True, "ipc": True, "shm": "HOSTPATH"},
    ),
    "hostIPC in both, own PID namespaces, equal PIDs": ({"pid": True}, {"pid": True}),
}


def test_legacy_ipc_matrix(daemon_factory, medium_model, tmp_path):
    hostpath = tmp_path / "shm"
    hostpath.mkdir(mode=0o1777)
    os.chmod(hostpath, 0o1777)
    results = {}
    only = os.environ.get("WEIGHTCACHE_MATRIX_ONLY")  # "|"-separated names, for re-runs
    for name, (dspec, espec) in SCENARIOS.items():
        if only and name not in only.split("|"):
            continue

        def fill(spec):
            if spec is None:
                return None
            spec = dict(spec)
            if spec.get("shm") == "HOSTPATH":
                spec["shm"] = str(hostpath)
            return ns(**spec)

        daemon = daemon_factory(medium_model, "cuda_ipc", prefix=fill(dspec))
        row = {"daemon_pid": daemon.info["pid"]}
        for preflight in ("0", "1"):
            code, report = run_probe(medium_model, daemon.socket, prefix=fill(espec),
                                     env={"WEIGHTCACHE_IPC_PREFLIGHT": preflight})
            key = "driver" if preflight == "0" else "client"
            row[key] = {"exit": code, "ok": report.get("ok"), "pid": report.get("pid"),
                        "error": report.get("error")}
            assert code in (0, 3), report  # attached, or our clear error: never a crash
        # The client's preflight must never refuse a setting the driver accepts.
        if row["driver"]["exit"] == 0:
            assert row["client"]["exit"] == 0, row
        daemon.stop()
        results[name] = row
        print(f"matrix {name}: {json.dumps(row)}", flush=True)
        target = os.environ.get("WEIGHTCACHE_ISOLATION_REPORT")
        if target:
            Path(target).write_text(json.dumps(results, indent=2))
    # Equal PIDs must fail (the driver says so; the client says why), distinct ones attach.
    for name, row in results.items():
        equal = row["daemon_pid"] == row["driver"]["pid"]
        assert (row["driver"]["exit"] != 0) == equal, (name, row)
