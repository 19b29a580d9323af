"""GPU identity: the canonical UUID of a device, from the driver or from a listing.

Daemon sockets are keyed by GPU UUID because a device index means nothing across
processes: an engine started with `CUDA_VISIBLE_DEVICES=3` calls physical GPU 3 `cuda:0`.
Both sides compute the UUID of the device they use, so they meet on the same socket and the
client can refuse a daemon that holds another GPU's memory.

This is the one place a GPU becomes an identity string: `weightcache.native.shared.identity` (socket
names) and the node agent's device discovery call it. Everything that needs CUDA is imported
lazily; the parsing helpers run anywhere.
"""

from __future__ import annotations

import re

from weightcache.errors import ProjectError

_MIG_RE = re.compile(r"^MIG-[0-9A-Za-z-]+$")
_UUID_RE = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8}(?:-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12})$")


class GpuError(ProjectError, RuntimeError):
    """A device could not be identified or resolved."""


def normalize_uuid(value: str) -> str:
    """Canonical `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` form (lower case, dashes)."""
    text = value.strip()
    m = _UUID_RE.match(text)
    if not m:
        raise GpuError(f"not a GPU UUID: {value!r}")
    hexdigits = m.group(1).replace("-", "").lower()
    parts = (hexdigits[0:8], hexdigits[8:12], hexdigits[12:16], hexdigits[16:20], hexdigits[20:32])
    return "GPU-" + "-".join(parts)


def uuid_from_bytes(raw: bytes) -> str:
    """UUID string from the 16 raw bytes the driver reports (`cuDeviceGetUuid`)."""
    if len(raw) != 16:
        raise GpuError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    return normalize_uuid(raw.hex())


def canonical_identity(value: str) -> str | None:
    """The identity a GPU is known by: its canonical UUID (MIG instances keep their own `MIG-`
    name), or None when `value` names no GPU.

    The node agent reads UUIDs from `NVIDIA_VISIBLE_DEVICES` or nvidia-smi and the daemons
    from the driver (`device_uuid`); both go through `normalize_uuid`, so they meet on the
    same socket name whatever case or dashes a source used.
    """
    text = value.strip()
    if _MIG_RE.match(text):
        return text
    try:
        return normalize_uuid(text) if text.startswith("GPU-") else None
    except GpuError:
        return None


def _driver():
    from .cudadriver import driver  # lazy: GPU nodes only (cuda-python or the ctypes binding)

    return driver()


def visible_device_uuids() -> list[str] | None:
    """The UUID of each CUDA device this process sees (CUDA_VISIBLE_DEVICES applied), by index,
    from the driver, without torch; None without a driver binding or a working driver.

    The launcher checks the layout against the devices before starting ranks; importing torch
    for that cost it ~5 s on the H200 VM, which every rank then paid again for its own import.

    The launcher asks once and hands each rank its device's UUID (`--device-uuid`), so the
    rank names its socket, takes its lock and starts its early reads without its own
    `cuInit` in front of them; the rank checks the UUID against its device once its CUDA
    context exists (`daemon/loading.py`). Each entry is what `device_uuid(index)` gives in a
    process with the same CUDA_VISIBLE_DEVICES.
    """
    try:
        cu = _driver()
        if int(cu.cuInit(0)[0]) != 0:
            return None
        err, count = cu.cuDeviceGetCount()
        if int(err) != 0:
            return None
        return [_driver_uuid(i) for i in range(int(count))]
    except Exception:  # no cuda-python, or no driver
        return None


def _torch_uuid(index: int) -> str | None:
    import torch  # a fallback; this module stays torch-free for the agent and launcher

    props = torch.cuda.get_device_properties(index)
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    return normalize_uuid(str(raw))


def device_uuid(device) -> str:
    """UUID of a CUDA device of this process (`torch.device`, index or `cuda:N` string).

    The driver first: a daemon rank names its socket (and takes its lock) before it imports
    torch, and reads its checkpoint while torch imports (`earlyread`); torch only where
    no driver binding is.
    """
    index = device_index(device)
    try:
        return _driver_uuid(index)
    except (ImportError, GpuError):
        pass
    found = _torch_uuid(index)
    if not found:
        raise GpuError(f"no UUID for CUDA device {index}")
    return found


def _driver_uuid(index: int) -> str:
    cu = _driver()
    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GpuError(f"cuInit failed: {err!r}")
    err, dev = cu.cuDeviceGet(index)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GpuError(f"cuDeviceGet({index}) failed: {err!r}")
    err, uuid = cu.cuDeviceGetUuid(dev)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise GpuError(f"cuDeviceGetUuid({index}) failed: {err!r}")
    return uuid_from_bytes(bytes(uuid.bytes))


def device_index(device) -> int:
    """CUDA ordinal of `device` in this process (default: the current device)."""
    if isinstance(device, int):
        return device
    import torch  # callers with a torch device have torch; the agent passes ints

    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise GpuError(f"not a CUDA device: {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()
