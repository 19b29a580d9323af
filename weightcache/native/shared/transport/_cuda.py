"""Shared helpers of the CUDA transports: driver loading, error checks, tensor views.

The driver binding (`cuda-python`'s `cuda.bindings.driver`, or the project's ctypes one:
`native/shared/cudadriver.py` chooses) is loaded on first use only, so CPU installs import the
transport modules without it and simply find the CUDA transports unavailable.
Tensors over raw device pointers are built through `__cuda_array_interface__`, a public
protocol torch consumes with `torch.as_tensor`; torch keeps a reference to the exporting
object for as long as any tensor (or view) uses the memory, which is what keeps a mapping
alive while an engine still holds its weights.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import cudadriver
from ..gpu import device_uuid
from .base import TransportError, TransportUnavailableError


def driver():
    """The driver binding this process calls (`cudadriver.driver`: cuda-python's, or the
    ctypes one where `WEIGHTCACHE_CUDA_DRIVER=ctypes`)."""
    try:
        return cudadriver.driver()
    except ImportError as exc:
        raise TransportUnavailableError(
            "CUDA transports need the driver bindings: pip install 'weightcache[cuda]'"
        ) from exc


def bindings():
    """cuda-python's driver module itself, for the calls the ctypes binding does not make
    (the daemon's staging)."""
    try:
        return cudadriver.bindings()
    except ImportError as exc:
        raise TransportUnavailableError(
            "this needs cuda-python's driver bindings: pip install 'weightcache[cuda]'"
        ) from exc


def _importable(get: Callable[[], Any]) -> bool:
    try:
        get()
    except TransportUnavailableError:
        return False
    return True


def bindings_importable() -> bool:
    """Whether a driver binding can be had (`driver()`), whichever it is."""
    return _importable(driver)


def full_bindings_importable() -> bool:
    """Whether cuda-python's own bindings can be had (`bindings()`)."""
    return _importable(bindings)


def error_name(err: Any) -> str:
    cu = driver()
    try:
        found, name = cu.cuGetErrorName(err)
        if int(found) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # naming the error must never hide it
        pass
    return str(err)


class CudaCallError(TransportError):
    """A driver call failed; `args[1]` is the CUresult."""

    @property
    def result(self) -> Any:
        return self.args[1] if len(self.args) > 1 else None

    def __str__(self) -> str:
        return str(self.args[0])


def check(result: Any, what: str, error: type[TransportError] = CudaCallError) -> Any:
    """Unpack a `cuda-python` result tuple, raising `error` on anything but success."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:  # CUDA_SUCCESS, whichever binding's enum `err` is
        raise error(f"{what} failed: {error_name(err)}", err)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


_ctx_lock = threading.Lock()
_primary: dict[int, Any] = {}


def device_ordinal(device: torch.device | str | int) -> int:
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise TransportUnavailableError(f"CUDA transports serve CUDA devices, not {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def make_current(ordinal: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    cu = driver()
    with _ctx_lock:
        ctx = _primary.get(ordinal)
        if ctx is None:
            check(cu.cuInit(0), "cuInit", CudaCallError)
            dev = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})", CudaCallError)
            ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain", CudaCallError)
            _primary[ordinal] = ctx
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", CudaCallError)


def cuda_usable(device: torch.device | str) -> bool:
    """Bindings importable, torch built with CUDA, and the device exists."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if dev.type != "cuda" or not bindings_importable():
        return False
    try:
        if not torch.cuda.is_available():
            return False
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return 0 <= index < torch.cuda.device_count()
    except RuntimeError:
        return False


class DeviceMemory:
    """Owner of a device address range; `release` runs once, when nothing views it.

    Tensors made by `tensor()` hold a reference to this object through torch's
    `__cuda_array_interface__` import, so the memory outlives `close()` of the arena or
    mapping for as long as an engine still holds weights that view it.
    """

    def __init__(self, ptr: int, nbytes: int, ordinal: int, release: Callable[[], None]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.ordinal = ordinal
        self._finalizer = weakref.finalize(self, _run_release, ordinal, release)
        self._finalizer.atexit = False  # the process exit frees device memory anyway

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        if self.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.ordinal}")
        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


# Errors of releases that ran from finalizers (they cannot raise); kept for diagnosis.
RELEASE_ERRORS: list[str] = []


class MappedImport:
    """Client side of a CUDA transport: a flat uint8 tensor over mapped device memory.

    `close` drops only this object's references: tensors an engine still holds keep the
    mapping, which is released with the last of them (DeviceMemory's finalizer).
    """

    nbytes: int = 0
    _memory: DeviceMemory | None = None
    _tensor: torch.Tensor | None = None

    def _adopt(self, memory: DeviceMemory, nbytes: int) -> None:
        self.nbytes = nbytes
        self._memory = memory
        self._tensor = memory.tensor()

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise TransportError("mapping is closed")
        return self._tensor

    def close(self) -> None:
        self._tensor = None
        self._memory = None


class DeviceArena:
    """Daemon side of a CUDA transport: one range of memory (one allocation, or with cuda_vmm a
    few side by side), a flat uint8 view of it, and its export as the metadata every client
    checks (transport, sizes, the GPU's UUID, the exporter's pid).

    The CUDA transports differ only in how the allocation is made, shared and released:
    subclasses allocate after `super().__init__` (setting `_memory`), and implement `_share`
    (the transport's own metadata fields and fds) and `_release` (what they hold besides the
    mapping).
    """

    transport: str = ""

    def __init__(self, nbytes: int, ordinal: int) -> None:
        if nbytes < 0:
            raise TransportError(f"arena size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self.ordinal = ordinal
        self.uuid = device_uuid(ordinal)
        self._memory: DeviceMemory | None = None
        self._tensor: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self._memory is None:
            raise TransportError("arena is closed")
        if self._tensor is None:
            self._tensor = self._memory.tensor()
        return self._tensor

    def export(self) -> tuple[dict[str, Any], list[int]]:
        if self._memory is None:
            raise TransportError("arena is closed")
        fields, fds = self._share()
        meta = {"transport": self.transport, "nbytes": self.nbytes, **fields,
                "uuid": self.uuid, "pid": os.getpid()}
        return meta, fds

    def close(self) -> None:
        """Drop the daemon's hold; views still held in this process keep the mapping."""
        if self._memory is None:
            return
        with contextlib.suppress(TransportError):
            synchronize(self.ordinal)
        self._release()
        self._tensor = None
        self._memory = None  # unmaps/frees now unless a view in this process still holds it

    def _share(self) -> tuple[dict[str, Any], list[int]]:
        raise NotImplementedError

    def _release(self) -> None:
        """Release what the transport holds besides the mapping (fds, handles)."""


class CudaTransport:
    """What the CUDA transports share: availability, allocation, and the checks before a map."""

    name: str = ""
    arena: type[DeviceArena] = DeviceArena

    def available(self, device: torch.device) -> bool:
        return cuda_usable(device)

    def allocate(self, nbytes: int, device: torch.device) -> DeviceArena:
        if not self.available(device):
            raise TransportUnavailableError(f"{self.name} cannot serve {device}")
        return self.arena(nbytes, device_ordinal(device))

    def target(self, meta: dict[str, Any], device: torch.device) -> int:
        """The ordinal to map onto: a usable CUDA device that is the GPU holding the arena."""
        ordinal = device_ordinal(device)
        if not self.available(device):
            raise TransportUnavailableError(f"{self.name} cannot map onto {device}")
        mine = device_uuid(ordinal)
        theirs = meta.get("uuid")
        if theirs and theirs != mine:
            raise TransportError(
                f"the daemon's arena lives on GPU {theirs}, this process uses {mine} "
                f"({device}); check CUDA_VISIBLE_DEVICES and the socket's GPU"
            )
        return ordinal


def _run_release(ordinal: int, release: Callable[[], None]) -> None:
    try:
        make_current(ordinal)
        release()
    except Exception as exc:  # a finalizer must never raise into the garbage collector
        if len(RELEASE_ERRORS) < 100:
            RELEASE_ERRORS.append(f"{type(exc).__name__}: {exc}")


def synchronize(ordinal: int) -> None:
    """Wait for outstanding work on the device before memory is unmapped or freed."""
    cu = driver()
    make_current(ordinal)
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize", CudaCallError)
