"""CUDA transport through the virtual memory management API and POSIX file descriptors.

Why this is the default on CUDA: the arena is one `cuMemCreate` allocation whose handle is
exported as a file descriptor and passed over the Unix socket with SCM_RIGHTS. Whoever holds
the fd can map the memory; nothing else is needed. Legacy CUDA IPC handles, by contrast,
name the exporting process by PID and go through /dev/shm, so they break between pods with
separate PID namespaces (equal PIDs) or private /dev/shm. The fd path works across PID, IPC
and mount namespaces: the only thing two pods must share is the socket directory.

The client imports the handle, reserves an address range, maps it and grants access; the
tensor is a view through `__cuda_array_interface__`, so no torch internals are involved.
A mapping stays valid when the daemon exits: the allocation lives while any process maps it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import _cuda
from .base import Imported, TransportError

NAME = "cuda_vmm"


def _handle_type():
    return _cuda.driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _prop(ordinal: int):
    cu = _cuda.driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _handle_type()
    return prop


def granularity(ordinal: int) -> int:
    """Allocation granularity (recommended) of the device, in bytes (2 MiB on Hopper)."""
    cu = _cuda.driver()
    _cuda.make_current(ordinal)
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_cuda.check(cu.cuMemGetAllocationGranularity(_prop(ordinal), flag), "granularity"))


def _map(handle: Any, size: int, ordinal: int, readonly: bool = False) -> int:
    """Reserve an address range, map `handle` into it and grant this device access."""
    cu = _cuda.driver()
    ptr = _cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        _cuda.check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        try:
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = ordinal
            flags = cu.CUmemAccess_flags
            desc.flags = (
                flags.CU_MEM_ACCESS_FLAGS_PROT_READ
                if readonly
                else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            _cuda.check(cu.cuMemSetAccess(ptr, size, [desc], 1), "cuMemSetAccess")
        except BaseException:
            cu.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        cu.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


def _unmap(ptr: int, size: int) -> None:
    cu = _cuda.driver()
    _cuda.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    _cuda.check(cu.cuMemUnmap(ptr, size), "cuMemUnmap")
    _cuda.check(cu.cuMemAddressFree(ptr, size), "cuMemAddressFree")


class VmmArena(_cuda.DeviceArena):
    """Daemon side: one `cuMemCreate` allocation, mapped read-write, exportable as an fd.

    Closing drops the daemon's hold (the fd, the allocation handle and the mapping); the
    physical memory goes back to the device once no process maps it any more: at once in copy
    mode (clients cloned and unmapped), or when the last zero-copy engine unmaps.
    """

    transport = NAME

    def __init__(self, nbytes: int, ordinal: int) -> None:
        super().__init__(nbytes, ordinal)
        cu = _cuda.driver()
        gran = granularity(ordinal)
        self.size = max(gran, (nbytes + gran - 1) // gran * gran)
        self._fd: int | None = None
        try:
            handle = _cuda.check(cu.cuMemCreate(self.size, _prop(ordinal), 0), "cuMemCreate")
        except TransportError as exc:
            raise TransportError(f"cannot allocate a {self.size}-byte VMM arena: {exc}") from exc
        self._handle: Any = handle
        try:
            ptr = _map(handle, self.size, ordinal)
        except BaseException:
            cu.cuMemRelease(handle)
            raise
        size = self.size
        self._memory = _cuda.DeviceMemory(ptr, nbytes, ordinal, lambda: _unmap(ptr, size))

    def _share(self) -> tuple[dict[str, Any], list[int]]:
        if self._fd is None:
            cu = _cuda.driver()
            _cuda.make_current(self.ordinal)
            fd = _cuda.check(
                cu.cuMemExportToShareableHandle(self._handle, _handle_type(), 0),
                "cuMemExportToShareableHandle",
            )
            self._fd = int(fd)
            os.set_inheritable(self._fd, False)
        return {"size": self.size}, [self._fd]

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _cuda.check(_cuda.driver().cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None


class VmmImported(_cuda.MappedImport):
    """Client side: the daemon's allocation mapped into this process."""

    def __init__(self, meta: dict[str, Any], fd: int, ordinal: int, readonly: bool) -> None:
        cu = _cuda.driver()
        try:
            nbytes, size = int(meta["nbytes"]), int(meta["size"])
        except (KeyError, TypeError, ValueError) as exc:
            os.close(fd)
            raise TransportError(f"bad cuda_vmm metadata: {meta!r}") from exc
        try:
            _cuda.make_current(ordinal)
            handle = _cuda.check(
                cu.cuMemImportFromShareableHandle(fd, _handle_type()),
                "cuMemImportFromShareableHandle",
            )
        finally:
            os.close(fd)  # the imported handle keeps the allocation alive
        try:
            ptr = _map(handle, size, ordinal, readonly=readonly)
        finally:
            cu.cuMemRelease(handle)  # the mapping keeps it; freed on unmap
        self._adopt(_cuda.DeviceMemory(ptr, nbytes, ordinal, lambda: _unmap(ptr, size)), nbytes)


class VmmTransport(_cuda.CudaTransport):
    name = NAME
    arena = VmmArena

    def attach(self, meta: dict[str, Any], fds: list[int], device: torch.device) -> Imported:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"cuda_vmm expects 1 fd, got {len(fds)}")
        try:
            ordinal = self.target(meta, device)
        except BaseException:
            os.close(fds[0])
            raise
        readonly = os.environ.get("WEIGHTCACHE_VMM_READONLY", "") in {"1", "true"}
        return VmmImported(meta, fds[0], ordinal, readonly=readonly)


TRANSPORT = VmmTransport()
