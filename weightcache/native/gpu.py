"""GPU identity: UUIDs, and `CUDA_VISIBLE_DEVICES` remapping.

Daemon sockets are keyed by GPU UUID because a device index means nothing across
processes: an engine started with `CUDA_VISIBLE_DEVICES=3` calls physical GPU 3 `cuda:0`.
Both sides compute the UUID of the device they use, so they meet on the same socket and the
client can refuse a daemon that holds another GPU's memory.

Everything that needs CUDA is imported lazily; the parsing helpers run anywhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"

_UUID_RE = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8}(?:-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12})$")


class GpuError(RuntimeError):
    """A device could not be identified or resolved."""


@dataclass(frozen=True)
class VisibleEntry:
    """One entry of `CUDA_VISIBLE_DEVICES`: a physical index, a (prefix of a) UUID, or MIG."""

    raw: str
    index: int | None = None
    uuid: str | None = None


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


def parse_visible_devices(value: str | None) -> list[VisibleEntry] | None:
    """Parse `CUDA_VISIBLE_DEVICES` the way the CUDA runtime does.

    None means unset (all devices visible, identity order). Parsing stops at the first
    invalid entry, as the runtime does; an empty string hides every device.
    """
    if value is None:
        return None
    entries: list[VisibleEntry] = []
    for item in value.split(","):
        token = item.strip()
        if not token:
            break
        if token.isdigit():
            entries.append(VisibleEntry(raw=token, index=int(token)))
        elif token.startswith("GPU-"):
            entries.append(VisibleEntry(raw=token, uuid="GPU-" + token[4:].lower()))
        elif token.startswith("MIG-"):
            entries.append(VisibleEntry(raw=token, uuid=token))
        else:
            break
    return entries


def physical_selector(index: int, env: Mapping[str, str] | None = None) -> str:
    """What CUDA ordinal `index` of this process stands for on the host.

    Returns the physical index as a string, or the UUID (or UUID prefix) named in
    `CUDA_VISIBLE_DEVICES`. The agent uses it to label ranks; sockets still use the UUID.
    """
    env = os.environ if env is None else env
    entries = parse_visible_devices(env.get(ENV_VISIBLE))
    if entries is None:
        return str(index)
    if index < 0 or index >= len(entries):
        raise GpuError(f"device {index} is not visible ({ENV_VISIBLE}={env.get(ENV_VISIBLE)!r})")
    entry = entries[index]
    return str(entry.index) if entry.index is not None else entry.raw


def match_uuid(entry: VisibleEntry, uuid: str) -> bool:
    """Whether a `CUDA_VISIBLE_DEVICES` UUID entry (possibly a prefix) names `uuid`."""
    if entry.uuid is None:
        return False
    return normalize_uuid(uuid).lower().startswith(entry.uuid.lower())


def _driver():
    from cuda.bindings import driver  # lazy: GPU nodes only

    return driver


def visible_device_count() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied), without torch.

    The launcher checks the layout before starting ranks; importing torch for that cost it
    ~5 s on the H200 VM, which every rank then paid again for its own import.
    """
    try:
        cu = _driver()
        if int(cu.cuInit(0)[0]) == 0:
            err, count = cu.cuDeviceGetCount()
            if int(err) == 0:
                return int(count)
    except Exception:  # no cuda-python, or no driver: ask torch as before
        pass
    import torch

    return torch.cuda.device_count()


def _torch_uuid(index: int) -> str | None:
    import torch

    props = torch.cuda.get_device_properties(index)
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    return normalize_uuid(str(raw))


def device_uuid(device) -> str:
    """UUID of a CUDA device of this process (`torch.device`, index or `cuda:N` string)."""
    index = device_index(device)
    try:
        found = _torch_uuid(index)
        if found:
            return found
    except (GpuError, AttributeError, RuntimeError):
        pass
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
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise GpuError(f"not a CUDA device: {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def resolve_device(spec: str | int) -> int:
    """CUDA ordinal in this process for a device named by ordinal, `cuda:N` or UUID.

    The daemon accepts any of these so an operator can pin a rank to a physical GPU by
    UUID whatever `CUDA_VISIBLE_DEVICES` the pod was given.
    """
    if isinstance(spec, int):
        return spec
    text = str(spec).strip()
    if text.isdigit():
        return int(text)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    import torch

    want = (normalize_uuid(text) if _UUID_RE.match(text) else text).lower()
    for index in range(torch.cuda.device_count()):
        have = device_uuid(index).lower()
        if have.startswith(want):
            return index
    raise GpuError(f"no visible CUDA device has UUID {text!r}")


def socket_key(uuid: str) -> str:
    """File-name-safe key of a GPU for socket names (the canonical UUID is already safe)."""
    return normalize_uuid(uuid)


def device_info(device) -> dict:
    """The `device` block of the `hello` reply for a CUDA device."""
    index = device_index(device)
    return {"kind": "cuda", "uuid": device_uuid(index), "index": index}
