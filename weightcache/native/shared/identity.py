"""Stable device identities and the socket names derived from them.

Sockets are named after the device, not after a process-local index, so an engine finds the
daemon that holds its device's weights whatever its CUDA_VISIBLE_DEVICES remapping. GPUs are
named by UUID; a CPU "device" (one per local rank) by a hash of the machine id plus the index,
so it is stable across restarts of both sides and distinct between machines sharing a
directory.
"""

from __future__ import annotations

import hashlib
import os
import socket as _socket
from pathlib import Path

from weightcache.contracts.vocabulary import ROLE_TARGET, canonical_role

from .gpu import device_uuid


def machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return _socket.gethostname()


def cpu_identity(index: int) -> str:
    digest = hashlib.sha256(machine_id().encode()).hexdigest()[:12]
    return f"cpu-{digest}-{index}"


def device_identity(kind: str, index: int) -> str:
    """Identity of local device `index` of `kind` ("cpu" or "cuda")."""
    if kind == "cpu":
        return cpu_identity(index)
    if kind == "cuda":
        return device_uuid(index)
    raise ValueError(f"unsupported device kind {kind!r}")


def socket_path(
    socket_dir: str | os.PathLike, device_identity: str, role: str = ROLE_TARGET
) -> Path:
    """`<dir>/<identity>.sock` for the target model, `<dir>/<identity>_draft.sock` for a draft."""
    role = canonical_role(role)
    if not device_identity or "/" in device_identity or device_identity.startswith("."):
        raise ValueError(f"bad device identity {device_identity!r}")
    suffix = "" if role == ROLE_TARGET else f"_{role}"
    return Path(socket_dir) / f"{device_identity}{suffix}.sock"
