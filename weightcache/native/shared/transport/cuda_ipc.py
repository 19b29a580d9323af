"""Legacy CUDA IPC transport (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`), for compatibility.

The 64-byte IPC handle travels as hex in the msgpack frame: no pickle, no fds. It is what
`torch.multiprocessing` and vLLM's `ipc_cache` use, with their restriction: the handle names
the exporting process by PID, and the driver refuses an importer whose PID equals the
exporter's, which is exactly what two pods with their own PID namespaces look like (both
PID 1). CUDA reports that as an opaque "invalid device context"; this client checks the
PIDs first and says what is wrong and what to do (use `cuda_vmm`, or give the daemon the
host PID namespace). docs/gpu.md records which pod settings were seen to work. Set
`WEIGHTCACHE_IPC_PREFLIGHT=0` to skip the check and see the driver's own answer.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from . import _cuda
from .base import Imported, TransportError

NAME = "cuda_ipc"
HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE
ENV_PREFLIGHT = "WEIGHTCACHE_IPC_PREFLIGHT"


class IpcIsolationError(TransportError):
    """The client's isolation makes legacy CUDA IPC impossible (and says why)."""


def _handle_bytes(handle: Any) -> bytes:
    # cuda-bindings exposes the struct only by address; read its 64 reserved bytes.
    return ctypes.string_at(int(handle.getPtr()), HANDLE_SIZE)


def _handle_from(raw: bytes) -> Any:
    cu = _cuda.driver()
    if len(raw) != HANDLE_SIZE:
        raise TransportError(f"a CUDA IPC handle has {HANDLE_SIZE} bytes, got {len(raw)}")
    handle = cu.CUipcMemHandle()
    ctypes.memmove(int(handle.getPtr()), raw, HANDLE_SIZE)
    return handle


class IpcArena(_cuda.DeviceArena):
    """Daemon side: one `cuMemAlloc` allocation (not torch's caching allocator: offset 0).

    Closing frees it (cuMemFree) once no view in this process is left.
    """

    transport = NAME

    def __init__(self, nbytes: int, ordinal: int) -> None:
        super().__init__(nbytes, ordinal)
        cu = _cuda.driver()
        _cuda.make_current(ordinal)
        try:
            ptr = int(_cuda.check(cu.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
        except TransportError as exc:
            raise TransportError(f"cannot allocate a {nbytes}-byte IPC arena: {exc}") from exc
        self._memory = _cuda.DeviceMemory(ptr, nbytes, ordinal, lambda: _free(ptr))
        self._handle: str | None = None

    def _share(self) -> tuple[dict[str, Any], list[int]]:
        if self._handle is None:
            assert self._memory is not None
            cu = _cuda.driver()
            _cuda.make_current(self.ordinal)
            handle = _cuda.check(cu.cuIpcGetMemHandle(self._memory.ptr), "cuIpcGetMemHandle")
            self._handle = _handle_bytes(handle).hex()
        return {"handle": self._handle, "offset": 0}, []


def _free(ptr: int) -> None:
    cu = _cuda.driver()
    _cuda.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    _cuda.check(cu.cuMemFree(ptr), "cuMemFree")


def _close_ipc(ptr: int) -> None:
    cu = _cuda.driver()
    _cuda.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    _cuda.check(cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def preflight(meta: dict[str, Any]) -> None:
    """Refuse, with a clear reason, the cases the driver cannot serve."""
    if os.environ.get(ENV_PREFLIGHT, "1") in {"0", "false", "no"}:
        return
    pid = meta.get("pid")
    if isinstance(pid, int) and pid == os.getpid():
        raise IpcIsolationError(
            f"legacy CUDA IPC cannot attach: the daemon's PID ({pid}) equals this process's PID, "
            "so the two run in separate PID namespaces (e.g. two pods, both PID 1) and the "
            "driver would take the handle for our own. Use transport 'cuda_vmm' (works across "
            "namespaces), or run the daemon with hostPID."
        )


class IpcImported(_cuda.MappedImport):
    def __init__(self, meta: dict[str, Any], ordinal: int) -> None:
        cu = _cuda.driver()
        try:
            nbytes, offset = int(meta["nbytes"]), int(meta.get("offset", 0))
            raw = bytes.fromhex(str(meta["handle"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"bad cuda_ipc metadata: {meta!r}") from exc
        preflight(meta)
        _cuda.make_current(ordinal)
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        try:
            base = int(_cuda.check(cu.cuIpcOpenMemHandle(_handle_from(raw), flags), "open"))
        except TransportError as exc:
            raise IpcIsolationError(
                f"legacy CUDA IPC cannot attach: cuIpcOpenMemHandle failed "
                f"({exc}). The daemon and this "
                "process need distinct PIDs (give the daemon hostPID); the 'cuda_vmm' transport "
                "has no such restriction."
            ) from exc
        memory = _cuda.DeviceMemory(base + offset, nbytes, ordinal, lambda: _close_ipc(base))
        self._adopt(memory, nbytes)


class IpcTransport(_cuda.CudaTransport):
    name = NAME
    arena = IpcArena

    def attach(self, meta: dict[str, Any], fds: list[int], device: torch.device) -> Imported:
        for fd in fds:  # this transport passes no fds; never leak any that came
            os.close(fd)
        return IpcImported(meta, self.target(meta, device))


TRANSPORT = IpcTransport()
