"""Host memory a daemon may still take (memlimit.py): the node's, capped by its memory cgroup.

The kernel's rule: a process whose cgroup goes past `memory.max` (v2) or
`memory.limit_in_bytes` (v1) and cannot reclaim is OOM-killed (Documentation/admin-guide/
cgroup-v2.rst, "memory.max"; cgroup-v1/memory.rst, section 2.5). The last test puts a real
process in a real cgroup with a limit and shows both sides: the early reads sized by memlimit
fit, and the same reads sized by the node's MemAvailable (what they used before) get the
process killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from weightcache.native.shared import memlimit

MiB = 1 << 20


def _proc(tmp: Path, cgroup: str, avail_kib: int = 8 << 20) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(f"MemTotal: {avail_kib * 2} kB\nMemAvailable: {avail_kib} kB\n")
    return proc


def _group(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text + "\n")


def test_v2_the_limit_less_the_working_set_of_the_group_and_its_ancestors(tmp_path):
    fs = tmp_path / "cg"
    _group(fs, {"cgroup.controllers": "cpuset cpu io memory pids"})
    pod, ctr = fs / "kubepods" / "pod1", fs / "kubepods" / "pod1" / "ctr"
    _group(pod, {"memory.max": str(6 << 30), "memory.current": str(1 << 30),
                 "memory.stat": "anon 100\ninactive_file 0\n"})
    # 3 GiB used, 1 GiB of it inactive file pages the kernel reclaims first: 2 GiB working set.
    _group(ctr, {"memory.max": str(4 << 30), "memory.current": str(3 << 30),
                 "memory.stat": f"anon {2 << 30}\nactive_file 0\ninactive_file {1 << 30}\n"})
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert memlimit.cgroup_room(proc, fs) == 2 << 30
    assert memlimit.available(proc, fs) == 2 << 30  # below the node's 8 GiB
    # The pod's limit is the tighter one once its other containers use memory.
    (pod / "memory.current").write_text(str(5 << 30))
    assert memlimit.cgroup_room(proc, fs) == 1 << 30
    # Over the limit in usage: no room, never a negative figure.
    (ctr / "memory.current").write_text(str(6 << 30))
    assert memlimit.cgroup_room(proc, fs) == 0
    # No limit anywhere: the node's figure.
    (ctr / "memory.max").write_text("max\n")
    (pod / "memory.max").write_text("max\n")
    assert memlimit.cgroup_room(proc, fs) is None
    assert memlimit.available(proc, fs) == 8 << 30


def test_v1_the_memory_hierarchy_beside_an_unified_one_without_the_controller(tmp_path):
    fs = tmp_path / "cg"
    _group(fs / "unified", {"cgroup.controllers": ""})  # hybrid: memory is v1's
    ctr = fs / "memory" / "kubepods" / "ctr"
    _group(fs / "memory", {"memory.limit_in_bytes": "9223372036854771712",
                           "memory.usage_in_bytes": str(50 << 30)})
    _group(ctr, {"memory.limit_in_bytes": str(1 << 30), "memory.usage_in_bytes": str(900 * MiB),
                 "memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {400 * MiB}\n"})
    proc = _proc(tmp_path, "12:pids:/kubepods/ctr\n4:cpuacct,memory:/kubepods/ctr\n0::/\n")
    assert memlimit.cgroup_room(proc, fs) == 1024 * MiB - 500 * MiB
    assert memlimit.available(proc, fs) == 524 * MiB


def test_a_containers_own_group_mounted_at_the_root(tmp_path):
    """Without a cgroup namespace the path names the host's tree, which the container's mount
    does not have: its root is the container's group."""
    fs = tmp_path / "cg"
    _group(fs, {"cgroup.controllers": "memory", "memory.max": str(2 << 30),
                "memory.current": str(512 * MiB), "memory.stat": "inactive_file 0\n"})
    proc = _proc(tmp_path, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope\n")
    assert memlimit.cgroup_room(proc, fs) == 1536 * MiB


def test_unreadable_or_absent_cgroups_leave_the_nodes_figure(tmp_path):
    fs = tmp_path / "cg"
    fs.mkdir()
    proc = _proc(tmp_path, "0::/\n", avail_kib=1024)
    assert memlimit.cgroup_room(proc, fs) is None
    assert memlimit.available(proc, fs) == 1 << 20
    _group(fs, {"cgroup.controllers": "memory", "memory.max": "not a number"})
    assert memlimit.available(proc, fs) == 1 << 20
    (proc / "meminfo").write_text("")
    assert memlimit.available(proc, fs) is None
    assert memlimit.available(tmp_path / "none", fs) is None


# -- a real cgroup ---------------------------------------------------------------------------
LIMIT = 160 * MiB

_CHILD = r"""
import json, sys
from weightcache.native.shared import earlyread, memlimit
path, how = sys.argv[1], sys.argv[2]
node = memlimit.node_available()
budget = earlyread.default_budget(1) if how == "memlimit" else node // 4
early = earlyread.EarlyReads([path], budget, direct=True, threads=4).start()
early.join()
stats = early.stop()
print(json.dumps({"budget": budget, "read": stats["read_bytes"], "node": node,
                  "room": memlimit.cgroup_room()}))
early.close()
"""


def _limited_group() -> tuple[Path, list[str]]:
    """A child of this process's memory cgroup, limited to LIMIT with no swap, or a skip."""
    found = memlimit.memory_groups()
    if found is None:
        pytest.skip("no memory cgroup readable here")
    groups, (limit_file, _, _) = found
    child = groups[0] / f"wc-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    files = [limit_file, "memory.swap.max" if limit_file == "memory.max"
             else "memory.memsw.limit_in_bytes"]
    try:
        for name in files:
            if (child / name).exists():
                (child / name).write_text(str(LIMIT) if name != "memory.swap.max" else "0")
    except OSError as exc:
        child.rmdir()
        pytest.skip(f"cannot limit a cgroup here: {exc}")
    return child, files


def test_early_reads_fit_a_containers_limit_that_the_nodes_memory_would_break(tmp_path):
    child, _ = _limited_group()
    ckpt = tmp_path / "model-00001-of-00001.safetensors"
    with open(ckpt, "wb") as fh:  # holes: the reads charge anonymous memory, not the disk
        fh.truncate(3 * LIMIT)
    try:
        def run(how: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["sh", "-c", f'echo $$ > "{child}/cgroup.procs" && exec "$0" "$@"',
                 sys.executable, "-c", _CHILD, str(ckpt), how],
                capture_output=True, text=True, timeout=120)

        fits = run("memlimit")
        assert fits.returncode == 0, fits.stderr[-2000:]
        out = json.loads(fits.stdout)
        assert out["room"] is not None and out["room"] <= LIMIT
        assert 0 < out["budget"] <= LIMIT // 4  # a quarter of the room when it was sized
        assert 0 < out["read"] <= out["budget"]  # whole jobs within it
        # What the node has free is far more than the container may take: sized by it, the
        # same reads take the whole file and the kernel kills the process.
        assert out["node"] // 4 > 3 * LIMIT
        broke = run("node")
        assert broke.returncode == -signal.SIGKILL, (broke.returncode, broke.stdout,
                                                     broke.stderr[-2000:])
    finally:
        for _ in range(50):
            try:
                child.rmdir()
                break
            except OSError:
                os.sched_yield()
