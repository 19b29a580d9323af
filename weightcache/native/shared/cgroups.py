"""What this process's cgroups let it use: host memory still free to take, and CPUs (torch-free).

Why: in a pod the node's figures are not the process's. `/proc/meminfo` and `os.cpu_count()`
describe the node, while the container may have a memory limit (a WeightCache's
`spec.resources`, or a namespace's LimitRange default), a CPU quota, or a set of exclusive cores
(the kubelet's static CPU manager gives a Guaranteed pod's containers their own `cpuset`).
- Memory: a daemon that goes past its limit is OOM-killed, with every engine attached to it.
  So every large host buffer a daemon sizes from what is free (an update's staging and rollback
  copy, the early reads' budget) asks `available_memory()`.
- CPUs: threads beyond the quota do no more work; they spend it sooner, and then every thread
  of the process waits out the rest of the period (the kernel's CFS bandwidth control,
  Documentation/scheduler/sched-bwc.rst), the threads that serve attaches and issue the disk's
  reads among them. So every pool of CPU-bound workers is sized from `usable_cpus()`.

The cgroup is found from `/proc/self/cgroup`: the unified hierarchy (`0::<path>`, cgroup v2)
where it carries the controller, else the controller's v1 hierarchy (still the default of some
GPU node images). A container usually sees its own group mounted at the hierarchy's root while
the path names the host's tree, so where the path does not exist under the mount the mount's
root is the group. The group and every ancestor visible above it are looked at: a pod-level
limit below the container's counts too.

Memory a group still allows is its limit less its working set: usage less the inactive file
pages (`inactive_file` in v2's `memory.stat`, `total_inactive_file` in v1's), which the kernel
reclaims within the group before it kills anything; it is the figure the kubelet evicts by
(Kubernetes' node-pressure eviction docs, `memory-available.sh`: usage less
`total_inactive_file`). A limit of "max" (v2) or of at least UNLIMITED bytes (v1 writes 2^63
less a page) is none.
CPUs are those of the process's affinity (its cpuset), at most the tightest quota rounded up
(v2 `cpu.max` "quota period", v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; "max" or -1: none).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

UNLIMITED = 1 << 60
PROC = Path("/proc")
CGROUP_FS = Path("/sys/fs/cgroup")

# Per hierarchy: the limit's file, the usage's file, and the memory.stat key of the inactive
# file pages (hierarchical in both).
_MEMORY_V2 = ("memory.max", "memory.current", "inactive_file")
_MEMORY_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def node_available(proc: Path = PROC) -> int | None:
    """MemAvailable of `/proc/meminfo`, in bytes."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def groups(controller: str, proc: Path = PROC, cgroup_fs: Path = CGROUP_FS
           ) -> tuple[list[Path], int] | None:
    """This process's cgroup of `controller` and its visible ancestors (innermost first), and
    the hierarchy's version (2 or 1); None where the controller's files cannot be found."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if ident == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    unified = cgroup_fs / "unified" if (cgroup_fs / "unified").is_dir() else cgroup_fs
    if v2 is not None and controller in _read(unified / "cgroup.controllers").split():
        root, path, version = unified, v2, 2
    elif v1 is not None and (cgroup_fs / controller).is_dir():
        root, path, version = cgroup_fs / controller, v1, 1
    else:
        return None
    group = root / path.lstrip("/")
    if not group.is_dir():
        group = root  # a container's own group, mounted at the root
    return [group, *(p for p in group.parents if p == root or root in p.parents)], version


def memory_room(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> int | None:
    """The least any of this process's memory cgroups still allows, in bytes (at least 0);
    None where none of them sets a limit or none can be read."""
    found = groups("memory", proc, cgroup_fs)
    if found is None:
        return None
    chain, version = found
    limit_file, usage_file, inactive_key = _MEMORY_V2 if version == 2 else _MEMORY_V1
    room: int | None = None
    for group in chain:
        with contextlib.suppress(OSError, ValueError):
            text = _read(group / limit_file)
            if text in {"", "max"} or int(text) >= UNLIMITED:
                continue
            used = int(_read(group / usage_file)) - _stat(group, inactive_key)
            left = max(0, int(text) - max(0, used))
            room = left if room is None else min(room, left)
    return room


def available_memory(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> int | None:
    """Bytes this process may still take: MemAvailable, capped by its cgroups' room; None
    where neither can be read."""
    node, room = node_available(proc), memory_room(proc, cgroup_fs)
    if node is None or room is None:
        return room if node is None else node
    return min(node, room)


def cpu_quota(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> float | None:
    """The tightest CPU quota of this process's cgroups, in CPUs; None where none is set."""
    found = groups("cpu", proc, cgroup_fs)
    if found is None:
        return None
    chain, version = found
    quota: float | None = None
    for group in chain:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if version == 2:
                text = _read(group / "cpu.max").split()
                if not text or text[0] == "max":
                    continue
                share = int(text[0]) / int(text[1])
            else:
                us = int(_read(group / "cpu.cfs_quota_us"))
                if us < 0:
                    continue
                share = us / int(_read(group / "cpu.cfs_period_us"))
            if share > 0:
                quota = share if quota is None else min(quota, share)
    return quota


def usable_cpus(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> int:
    """CPUs this process can keep busy at once: its affinity, at most its quota rounded up."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = cpu_quota(proc, cgroup_fs)
    if quota is not None:
        count = min(count, math.ceil(quota - 1e-9))
    return max(1, count)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _stat(group: Path, key: str) -> int:
    for line in _read(group / "memory.stat").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0
