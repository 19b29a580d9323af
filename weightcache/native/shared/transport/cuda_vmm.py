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

An arena may be made of several allocations (`WEIGHTCACHE_VMM_PIECES`, one fd each) mapped
side by side into one reserved range, so daemon and clients still see one flat arena. Why:
the driver maps and grants access only to a whole allocation (granting part of one mapping
fails with CUDA_ERROR_INVALID_VALUE, mapping at an offset with CUDA_ERROR_NOT_SUPPORTED on
driver 580), so with one allocation copy mode's copy waits for the whole map. With pieces, a
client maps lazily: `tensor()` maps them all (zero copy), `copy_into` maps one piece at a
time and queues its copy at once, so the copy runs beside the rest of the map.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..loadenv import positive
from ..protocol import MAX_FDS
from . import _cuda
from .base import Imported, TransportError

NAME = "cuda_vmm"
PIECES_ENV = "WEIGHTCACHE_VMM_PIECES"
# Four: the copy ran beside the map in every A/B where it counted (run51 on the H200: into a
# kept block 1.437-1.522 TB/s against 1.365-1.393 with one allocation, the driver's own map +
# copy + unmap 8.45 ms against 9.53; run52 on an H100: into fresh memory 1.099-1.113 against
# 1.075-1.077), and 8 or 16 pieces no faster than 4 (run51's probe: 8.47 / 8.81 ms). A
# zero_copy attach maps four handles: 3.2 ms median either way on run52's H100, 0.35 ms more
# on run56's (4.6-5.1 against 4.1-4.3 ms), under the 10 ms target.
DEFAULT_PIECES = 4


def pieces() -> int:
    """How many allocations a new arena is made of (`WEIGHTCACHE_VMM_PIECES`, 1 to the fds one
    frame may carry, default DEFAULT_PIECES; an arena smaller than that many granules has
    fewer); a bad value is the default: the knob tunes speed only."""
    return min(positive(PIECES_ENV, DEFAULT_PIECES), MAX_FDS)


def piece_sizes(nbytes: int, gran: int, count: int) -> list[int]:
    """An arena of `nbytes` cut into at most `count` allocations, each a multiple of `gran`,
    as even as the granularity allows; their sum is the arena's size rounded up to `gran`."""
    units = max(1, (nbytes + gran - 1) // gran)
    count = max(1, min(count, units))
    base, extra = divmod(units, count)
    return [(base + (i < extra)) * gran for i in range(count)]


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


def _map_at(ptr: int, size: int, handle: Any, ordinal: int, readonly: bool = False) -> None:
    """Map one whole allocation at `ptr` (inside a reserved range) and grant this device
    access."""
    cu = _cuda.driver()
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


class _Range:
    """A reserved address range and the pieces mapped into it so far, in order; `release`
    unmaps them and frees the range (once the device is idle)."""

    def __init__(self, size: int) -> None:
        cu = _cuda.driver()
        self.size = size
        self.ptr = int(_cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0),
                                   "cuMemAddressReserve"))
        self.mapped: list[tuple[int, int]] = []
        self.end = 0  # bytes mapped from the start

    def map(self, handle: Any, size: int, ordinal: int, readonly: bool = False) -> int:
        """Map the next piece; its address."""
        at = self.ptr + self.end
        _map_at(at, size, handle, ordinal, readonly)
        self.mapped.append((at, size))
        self.end += size
        return at

    def release(self, synchronize: bool = True) -> None:
        cu = _cuda.driver()
        if synchronize and self.mapped:
            _cuda.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        while self.mapped:
            at, size = self.mapped.pop()
            _cuda.check(cu.cuMemUnmap(at, size), "cuMemUnmap")
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _cuda.check(cu.cuMemAddressFree(ptr, self.size), "cuMemAddressFree")


class VmmArena(_cuda.DeviceArena):
    """Daemon side: `cuMemCreate` allocations (one, or `pieces()`) mapped read-write side by
    side, each exportable as an fd.

    Closing drops the daemon's hold (the fds, the allocation handles and the mapping); the
    physical memory goes back to the device once no process maps it any more: at once in copy
    mode (clients cloned and unmapped), or when the last zero-copy engine unmaps.
    """

    transport = NAME

    def __init__(self, nbytes: int, ordinal: int, count: int | None = None) -> None:
        super().__init__(nbytes, ordinal)
        cu = _cuda.driver()
        self.sizes = piece_sizes(nbytes, granularity(ordinal), pieces() if count is None
                                 else count)
        self.size = sum(self.sizes)
        self._fds: list[int] = []
        self._handles: list[Any] = []
        try:
            for size in self.sizes:
                self._handles.append(_cuda.check(cu.cuMemCreate(size, _prop(ordinal), 0),
                                                 "cuMemCreate"))
        except TransportError as exc:
            self._release()
            raise TransportError(f"cannot allocate a {self.size}-byte VMM arena"
                                 f" ({len(self.sizes)} pieces): {exc}") from exc
        span: _Range | None = None
        try:
            span = _Range(self.size)
            for handle, size in zip(self._handles, self.sizes, strict=True):
                span.map(handle, size, ordinal)
        except BaseException:
            if span is not None:
                span.release(synchronize=False)
            self._release()
            raise
        self._memory = _cuda.DeviceMemory(span.ptr, nbytes, ordinal, span.release)

    def _share(self) -> tuple[dict[str, Any], list[int]]:
        if not self._fds:
            cu = _cuda.driver()
            _cuda.make_current(self.ordinal)
            for handle in self._handles:
                fd = int(_cuda.check(
                    cu.cuMemExportToShareableHandle(handle, _handle_type(), 0),
                    "cuMemExportToShareableHandle",
                ))
                os.set_inheritable(fd, False)
                self._fds.append(fd)
        return {"size": self.size, "pieces": list(self.sizes)}, list(self._fds)

    def _release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        cu = _cuda.driver()
        while self._handles:
            _cuda.check(cu.cuMemRelease(self._handles.pop()), "cuMemRelease")


def _sizes(meta: dict[str, Any], nfds: int) -> tuple[int, int, list[int]]:
    """(nbytes, size, piece sizes) of an export, checked against the fds that came with it."""
    try:
        nbytes, size = int(meta["nbytes"]), int(meta["size"])
        sizes = [int(n) for n in meta.get("pieces") or [size]]
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"bad cuda_vmm metadata: {meta!r}") from exc
    if len(sizes) != nfds:
        raise TransportError(f"cuda_vmm arena of {len(sizes)} pieces came with {nfds} fds")
    if min(sizes) <= 0 or sum(sizes) != size or not 0 <= nbytes <= size:
        raise TransportError(f"bad cuda_vmm metadata: {meta!r}")
    return nbytes, size, sizes


class VmmImported(_cuda.MappedImport):
    """Client side: the daemon's allocations, mapped into one range of this process when
    first needed (`tensor`, or `copy_into` a piece at a time)."""

    def __init__(self, meta: dict[str, Any], fds: list[int], ordinal: int,
                 readonly: bool) -> None:
        self._fds = list(fds)  # unmapped pieces' fds, closed as each is mapped
        try:
            nbytes, size, self._sizes = _sizes(meta, len(fds))
            _cuda.make_current(ordinal)
            self._span = _Range(size)
        except BaseException:
            self._close_fds()
            raise
        self._ordinal, self._readonly = ordinal, readonly
        self.nbytes = nbytes
        # The memory's owner from the start, so that the range is released however the
        # mapping ends (a failed piece included); a tensor over it only once all is mapped.
        self._memory = _cuda.DeviceMemory(self._span.ptr, nbytes, ordinal, self._span.release)

    def _close_fds(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def _map_next(self) -> tuple[int, int]:
        """Import and map the next piece: (its offset in the arena, its size)."""
        cu = _cuda.driver()
        size = self._sizes[len(self._span.mapped)]
        fd = self._fds.pop(0)
        try:
            handle = _cuda.check(
                cu.cuMemImportFromShareableHandle(fd, _handle_type()),
                "cuMemImportFromShareableHandle",
            )
        finally:
            os.close(fd)  # the imported handle keeps the allocation alive
        try:
            at = self._span.end
            self._span.map(handle, size, self._ordinal, self._readonly)
        finally:
            cu.cuMemRelease(handle)  # the mapping keeps it; freed on unmap
        return at, size

    def _map_rest(self) -> None:
        if self._memory is None:
            raise TransportError("mapping is closed")
        while self._fds:
            self._map_next()

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._map_rest()
            assert self._memory is not None
            self._tensor = self._memory.tensor()
        return self._tensor

    def copy_into(self, take: Callable[[], torch.Tensor], nbytes: int) -> torch.Tensor:
        """Queue a copy of the arena's first `nbytes` into the block `take()` gives (flat
        uint8, on this device, on the current stream), a piece at a time as each is mapped:
        the copy of one piece runs while the next is mapped. `take` is called once the first
        piece is mapped (a block allocated meanwhile has had that long). The block."""
        if self._memory is None:
            raise TransportError("mapping is closed")
        if nbytes > self.nbytes:
            raise TransportError(f"cannot copy {nbytes} bytes of a {self.nbytes}-byte arena")
        cu = _cuda.driver()
        block: torch.Tensor | None = None
        stream = 0
        while self._fds:
            at, size = self._map_next()
            if block is None:
                block = take()
                stream = torch.cuda.current_stream(block.device).cuda_stream
            n = min(size, nbytes - at)
            if n > 0:
                _cuda.check(cu.cuMemcpyDtoDAsync(block.data_ptr() + at, self._span.ptr + at,
                                                 n, stream), "cuMemcpyDtoDAsync")
        if block is None:  # mapped before (tensor()): one copy of the whole
            block = take()
            block[:nbytes].copy_(self.tensor()[:nbytes], non_blocking=True)
        return block

    def close(self) -> None:
        self._close_fds()
        super().close()


class VmmTransport(_cuda.CudaTransport):
    name = NAME
    arena = VmmArena

    def attach(self, meta: dict[str, Any], fds: list[int], device: torch.device) -> Imported:
        try:
            if not fds:
                raise TransportError("cuda_vmm expects an fd per piece, got none")
            ordinal = self.target(meta, device)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        readonly = os.environ.get("WEIGHTCACHE_VMM_READONLY", "") in {"1", "true"}
        return VmmImported(meta, fds, ordinal, readonly=readonly)


TRANSPORT = VmmTransport()
