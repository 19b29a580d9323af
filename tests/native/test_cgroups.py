"""What a pod's cgroups let a daemon use (cgroups.py): host memory still free to take, and CPUs.

The kernel's rule: a process whose cgroup goes past `memory.max` (v2) or
`memory.limit_in_bytes` (v1) and cannot reclaim is OOM-killed (Documentation/admin-guide/
cgroup-v2.rst, "memory.max"; cgroup-v1/memory.rst, section 2.5). The last test puts a real
process in a real cgroup with a limit and shows both sides: the early reads sized by cgroups.py
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

from weightcache.native.shared import cgroups

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
    assert cgroups.memory_room(proc, fs) == 2 << 30
    assert cgroups.available_memory(proc, fs) == 2 << 30  # below the node's 8 GiB
    # The pod's limit is the tighter one once its other containers use memory.
    (pod / "memory.current").write_text(str(5 << 30))
    assert cgroups.memory_room(proc, fs) == 1 << 30
    # Over the limit in usage: no room, never a negative figure.
    (ctr / "memory.current").write_text(str(6 << 30))
    assert cgroups.memory_room(proc, fs) == 0
    # No limit anywhere: the node's figure.
    (ctr / "memory.max").write_text("max\n")
    (pod / "memory.max").write_text("max\n")
    assert cgroups.memory_room(proc, fs) is None
    assert cgroups.available_memory(proc, fs) == 8 << 30


def test_v1_the_memory_hierarchy_beside_an_unified_one_without_the_controller(tmp_path):
    fs = tmp_path / "cg"
    _group(fs / "unified", {"cgroup.controllers": ""})  # hybrid: memory is v1's
    ctr = fs / "memory" / "kubepods" / "ctr"
    _group(fs / "memory", {"memory.limit_in_bytes": "9223372036854771712",
                           "memory.usage_in_bytes": str(50 << 30)})
    _group(ctr, {"memory.limit_in_bytes": str(1 << 30), "memory.usage_in_bytes": str(900 * MiB),
                 "memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {400 * MiB}\n"})
    proc = _proc(tmp_path, "12:pids:/kubepods/ctr\n4:cpuacct,memory:/kubepods/ctr\n0::/\n")
    assert cgroups.memory_room(proc, fs) == 1024 * MiB - 500 * MiB
    assert cgroups.available_memory(proc, fs) == 524 * MiB


def test_a_containers_own_group_mounted_at_the_root(tmp_path):
    """Without a cgroup namespace the path names the host's tree, which the container's mount
    does not have: its root is the container's group."""
    fs = tmp_path / "cg"
    _group(fs, {"cgroup.controllers": "memory", "memory.max": str(2 << 30),
                "memory.current": str(512 * MiB), "memory.stat": "inactive_file 0\n"})
    proc = _proc(tmp_path, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope\n")
    assert cgroups.memory_room(proc, fs) == 1536 * MiB


def test_unreadable_or_absent_cgroups_leave_the_nodes_figure(tmp_path):
    fs = tmp_path / "cg"
    fs.mkdir()
    proc = _proc(tmp_path, "0::/\n", avail_kib=1024)
    assert cgroups.memory_room(proc, fs) is None
    assert cgroups.available_memory(proc, fs) == 1 << 20
    _group(fs, {"cgroup.controllers": "memory", "memory.max": "not a number"})
    assert cgroups.available_memory(proc, fs) == 1 << 20
    (proc / "meminfo").write_text("")
    assert cgroups.available_memory(proc, fs) is None
    assert cgroups.available_memory(tmp_path / "none", fs) is None


def test_cpus_are_the_tightest_quota_rounded_up_within_the_affinity(tmp_path):
    fs = tmp_path / "cg"
    _group(fs, {"cgroup.controllers": "cpu memory"})
    pod, ctr = fs / "kubepods" / "pod1", fs / "kubepods" / "pod1" / "ctr"
    _group(pod, {"cpu.max": "max 100000"})
    _group(ctr, {"cpu.max": "150000 100000"})
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cgroups.cpu_quota(proc, fs) == 1.5
    affinity = len(os.sched_getaffinity(0))
    assert cgroups.usable_cpus(proc, fs) == min(affinity, 2)
    (pod / "cpu.max").write_text("50000 100000\n")  # half a CPU at the pod: still one thread
    assert cgroups.cpu_quota(proc, fs) == 0.5
    assert cgroups.usable_cpus(proc, fs) == 1
    (pod / "cpu.max").write_text("max 100000\n")
    (ctr / "cpu.max").write_text("max 100000\n")
    assert cgroups.cpu_quota(proc, fs) is None
    assert cgroups.usable_cpus(proc, fs) == affinity
    # v1: cpu,cpuacct mounted together, -1 for no quota.
    fs1 = tmp_path / "cg1"
    _group(fs1 / "cpu" / "k" / "c", {"cpu.cfs_quota_us": "300000", "cpu.cfs_period_us": "100000"})
    _group(fs1 / "cpu" / "k", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    proc1 = tmp_path / "p1"
    (proc1 / "self").mkdir(parents=True)
    (proc1 / "self" / "cgroup").write_text("3:cpu,cpuacct:/k/c\n4:memory:/k/c\n")
    assert cgroups.cpu_quota(proc1, fs1) == 3.0
    assert cgroups.usable_cpus(proc1, fs1) == min(affinity, 3)


# -- a real cgroup ---------------------------------------------------------------------------
LIMIT = 160 * MiB

_CHILD = r"""
import json, sys
from weightcache.native.shared import cgroups, earlyread
path, how = sys.argv[1], sys.argv[2]
node = cgroups.node_available()
budget = earlyread.default_budget(1) if how == "cgroups" else node // 4
early = earlyread.EarlyReads([path], budget, direct=True, threads=4).start()
early.join()
stats = early.stop()
print(json.dumps({"budget": budget, "read": stats["read_bytes"], "node": node,
                  "room": cgroups.memory_room()}))
early.close()
"""


def _child_group(controller: str) -> tuple[Path, int]:
    """A new child of this process's `controller` cgroup, and the hierarchy's version; or a
    skip where this machine has none or lets no one make one."""
    found = cgroups.groups(controller)
    if found is None:
        pytest.skip(f"no {controller} cgroup readable here")
    chain, version = found
    child = chain[0] / f"wc-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    return child, version


def _in_group(child: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", f'echo $$ > "{child}/cgroup.procs" && exec "$0" "$@"',
                           *argv], capture_output=True, text=True, timeout=120)


def _remove(child: Path) -> None:
    for _ in range(50):
        try:
            child.rmdir()
            return
        except OSError:
            os.sched_yield()


def _limited_group() -> tuple[Path, bool]:
    """A child of this process's memory cgroup limited to LIMIT, and whether swap is out of
    reach there too (no swap on the machine, or a swap limit written); or a skip."""
    child, version = _child_group("memory")
    limit_file, swap_file = (("memory.max", "memory.swap.max") if version == 2
                             else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
    try:
        (child / limit_file).write_text(str(LIMIT))
        no_swap = any(line.split()[:2] == ["SwapTotal:", "0"]
                      for line in Path("/proc/meminfo").read_text().splitlines())
        if (child / swap_file).exists():
            (child / swap_file).write_text("0" if version == 2 else str(LIMIT))
            no_swap = True
    except OSError as exc:
        _remove(child)
        pytest.skip(f"cannot limit a cgroup here: {exc}")
    return child, no_swap


def test_early_reads_fit_a_containers_limit_that_the_nodes_memory_would_break(tmp_path):
    child, no_swap = _limited_group()
    ckpt = tmp_path / "model-00001-of-00001.safetensors"
    with open(ckpt, "wb") as fh:  # holes: the reads charge anonymous memory, not the disk
        fh.truncate(3 * LIMIT)
    try:
        def run(how: str) -> subprocess.CompletedProcess[str]:
            return _in_group(child, sys.executable, "-c", _CHILD, str(ckpt), how)

        fits = run("cgroups")
        assert fits.returncode == 0, fits.stderr[-2000:]
        out = json.loads(fits.stdout)
        assert out["room"] is not None and out["room"] <= LIMIT
        assert 0 < out["budget"] <= LIMIT // 4  # a quarter of the room when it was sized
        assert 0 < out["read"] <= out["budget"]  # whole jobs within it
        # What the node has free is far more than the container may take: sized by it, the
        # same reads take the whole file and the kernel kills the process.
        assert out["node"] // 4 > 3 * LIMIT
        broke = run("node")
        if no_swap:
            assert broke.returncode == -signal.SIGKILL, (broke.returncode, broke.stdout,
                                                         broke.stderr[-2000:])
        else:  # swap took what the limit did not: the reads still went past it
            assert broke.returncode == 0, broke.stderr[-2000:]
            assert json.loads(broke.stdout)["read"] == 3 * LIMIT
    finally:
        _remove(child)


_CPUS = r"""
import json, os
from weightcache.native.shared import cgroups, coldload
print(json.dumps({"cpus": cgroups.usable_cpus(), "quota": cgroups.cpu_quota(),
                  "slots": coldload.cpu_slots(32), "count": os.cpu_count()}))
"""


def test_a_real_cpu_quota_and_affinity_bound_the_workers():
    """A process in a cgroup of half a CPU sizes its pools for one thread, whatever the node's
    count; one whose affinity is a single core likewise."""
    child, version = _child_group("cpu")
    try:
        if version == 2:
            (child / "cpu.max").write_text("50000 100000")
        else:
            (child / "cpu.cfs_period_us").write_text("100000")
            (child / "cpu.cfs_quota_us").write_text("50000")
        out = _in_group(child, sys.executable, "-c", _CPUS)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        assert got["quota"] == 0.5 and got["cpus"] == got["slots"] == 1, got
    finally:
        _remove(child)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: affinity cannot narrow it")
    pinned = subprocess.run(
        [sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})"
         "\n" + _CPUS], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(pinned.stdout)
    assert got["cpus"] == got["slots"] == 1 < got["count"], got
