"""Host memory this process may still take: the node's, capped by its memory cgroup (torch-free).

Why: in a pod the node may have memory to spare while the container's limit is nearly reached
(a WeightCache's `spec.resources` may set one), and a daemon that goes past it is OOM-killed,
with every engine that attached to it. `/proc/meminfo` is the node's and knows nothing of the
container. So every large host buffer a daemon sizes from what is free (an update's staging and
rollback copy, the early reads' budget) asks here.

The cgroup is found from `/proc/self/cgroup`: the unified hierarchy (`0::<path>`, cgroup v2)
where it carries the memory controller, else the v1 `memory` hierarchy (still the default of
some GPU node images). A container usually sees its own group mounted at the hierarchy's root
while the path names the host's tree, so where the path does not exist under the mount the
mount's root is the group. The group and every ancestor visible above it are looked at: a
pod-level limit below the container's counts too.

What a group still allows is its limit less its working set: usage less the inactive file
pages (`inactive_file` in v2's `memory.stat`, `total_inactive_file` in v1's), which the kernel
reclaims within the group before it kills anything. It is the figure the kubelet evicts by.
A limit of "max" (v2) or of at least UNLIMITED bytes (v1 writes 2^63 less a page) is none.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

UNLIMITED = 1 << 60
PROC = Path("/proc")
CGROUP_FS = Path("/sys/fs/cgroup")

# Per hierarchy: the limit's file, the usage's file, and the memory.stat key of the inactive
# file pages (hierarchical in both).
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def node_available(proc: Path = PROC) -> int | None:
    """MemAvailable of `/proc/meminfo`, in bytes."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def memory_groups(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS
                  ) -> tuple[list[Path], tuple[str, str, str]] | None:
    """This process's memory cgroup and its visible ancestors (innermost first), and the
    hierarchy's file names; None where no memory controller can be read."""
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
        elif "memory" in controllers.split(","):
            v1 = path
    unified = cgroup_fs / "unified" if (cgroup_fs / "unified").is_dir() else cgroup_fs
    if v2 is not None and "memory" in _read(unified / "cgroup.controllers").split():
        root, path, names = unified, v2, _V2
    elif v1 is not None and (cgroup_fs / "memory").is_dir():
        root, path, names = cgroup_fs / "memory", v1, _V1
    else:
        return None
    group = root / path.lstrip("/")
    if not group.is_dir():
        group = root  # a container's own group, mounted at the root
    groups = [group, *(p for p in group.parents if p == root or root in p.parents)]
    return groups, names


def cgroup_room(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> int | None:
    """The least any of this process's memory cgroups still allows, in bytes (at least 0);
    None where none of them sets a limit or none can be read."""
    found = memory_groups(proc, cgroup_fs)
    if found is None:
        return None
    groups, (limit_file, usage_file, inactive_key) = found
    room: int | None = None
    for group in groups:
        with contextlib.suppress(OSError, ValueError):
            text = _read(group / limit_file)
            if text in {"", "max"} or int(text) >= UNLIMITED:
                continue
            used = int(_read(group / usage_file)) - _stat(group, inactive_key)
            left = max(0, int(text) - max(0, used))
            room = left if room is None else min(room, left)
    return room


def available(proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> int | None:
    """Bytes this process may still take: MemAvailable, capped by its cgroups' room; None
    where neither can be read."""
    node, room = node_available(proc), cgroup_room(proc, cgroup_fs)
    if node is None or room is None:
        return room if node is None else node
    return min(node, room)


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
