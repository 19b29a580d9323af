"""The few CUDA driver calls the CUDA transports make, bound with ctypes, called like
`cuda.bindings.driver`.

Why: an engine's first attach in a new process imported `cuda.bindings.driver`, a large Cython
module, for a dozen driver calls; the import alone cost ~16 ms, half of the attach. torch has
already loaded `libcuda.so.1` into the process by then, so `ctypes.CDLL` of it is a `dlopen`
that finds the library loaded, and resolving the symbols below costs microseconds.

Calling convention: the same as the bindings', so that `_cuda.py`, `cuda_vmm.py`, `cuda_ipc.py`
and `gpu.py` use this module as `cu` unchanged. Each function returns a tuple whose first item
is the CUresult: `(err,)` for a call with no output, `(err, value)` for one with one output,
and `(err, None)` when the call failed (what cuda-bindings 13.3 returns too, checked against it
over a stand-in libcuda). Outputs are plain ints where the bindings return an int-convertible
object (CUdevice, CUcontext, CUdeviceptr, CUmemGenericAllocationHandle, granularity, fd), and
these ints are accepted back wherever the bindings take those objects. The structs are ctypes
Structures with the bindings' attribute names (`prop.location.type = ...` works), plus the
bindings' `getPtr()` (their address), which `cuda_ipc.py` reads the IPC handle through. A
result code this module does not name comes back as a plain int, which compares with
`CUresult.CUDA_SUCCESS` like a member does.

Symbols: the versioned names cuda.h maps the API names to, resolved by `dlsym` (ctypes
attribute lookup). Rules, from cuda.h (CUDA 13.0's include/cuda.h, lines
89-154; CUDA 11.x and 12.x headers have the same lines for these calls):

    #define cuMemAlloc           cuMemAlloc_v2
    #define cuMemFree            cuMemFree_v2
    #define cuMemcpyDtoDAsync    __CUDA_API_PTSZ(cuMemcpyDtoDAsync_v2)
    #define cuIpcOpenMemHandle   cuIpcOpenMemHandle_v2
    #define cuDeviceGetUuid      cuDeviceGetUuid_v2      (CUDA 13.0 only, see below)

Every other call used here has no `#define` and is its own symbol (cuInit, cuDeviceGet,
cuDeviceGetCount, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuCtxSynchronize, cuGetErrorName,
cuMemGetAllocationGranularity, cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap,
cuMemSetAccess, cuMemCreate, cuMemRelease, cuMemExportToShareableHandle,
cuMemImportFromShareableHandle, cuIpcGetMemHandle, cuIpcCloseMemHandle). The unversioned
`cuMemAlloc`, `cuMemFree` and `cuMemcpyDtoDAsync` symbols libcuda still exports are the old
ABI with 32-bit pointers and sizes (cuda.h's `__CUDA_API_VERSION_INTERNAL` block:
`cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)`), so binding the plain name would be
a silent truncation, not a failure. `__CUDA_API_PTSZ` adds `_ptsz` only when compiling with
per-thread default streams; the plain `_v2` is what the bindings call too unless
CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM is set (stream 0 is the legacy default stream).

cuDeviceGetUuid: CUDA 13.0's cuda.h maps it to `cuDeviceGetUuid_v2`, and cuda-bindings 13.x's
`cuDeviceGetUuid` calls `cuDeviceGetUuid_v2`; CUDA 11.4-12.x headers left `cuDeviceGetUuid` as
the first version, which cuda-bindings 12.x's `cuDeviceGetUuid` calls. The two differ only on
a MIG instance: `_v2` returns the MIG instance's UUID, the first version the parent GPU's. This
module binds `_v2`: the UUID names the device this process uses, as the bindings 13.x give it.

Why `dlsym` and not `cuGetProcAddress`: the versioned symbols are the driver's stable ABI (every
binary built against cuda.h links to them, so a driver keeps exporting them), none of these
calls has a per-thread-stream variant we want, and `dlsym` needs no call into the driver before
`cuInit`. A driver that lacks one of them (older than CUDA 11.4, which added
cuDeviceGetUuid_v2) fails `load()`, and the caller falls back to the bindings.

Loading: importing this module opens nothing. `load()` opens `libcuda.so.1` (ctypes'
default mode) and resolves every symbol once; it raises `LibcudaUnavailable` (an ImportError)
when the library cannot be opened or lacks a symbol, so a caller can do
`try: _libcuda.load() except ImportError: from cuda.bindings import driver`. A call made
before `load()` loads first, and raises the same error.

Struct layouts are cuda.h's (x86-64 and aarch64 Linux, LP64): CUmemAllocationProp is 32 bytes
(type @0, requestedHandleTypes @4, location @8, win32HandleMetaData @16, allocFlags @24),
CUmemAccessDesc 12, CUipcMemHandle 64, CUuuid 16; tests/native/test_libcuda.py checks them.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Sequence
from typing import Any

LIBRARY = "libcuda.so.1"


class LibcudaUnavailable(ImportError):
    """libcuda.so.1 cannot be opened here, or lacks a symbol this module binds."""


# --- enums (values from cuda.h; only members every cuda-bindings >= 12.6 also has) ----------


class CUresult(enum.IntEnum):
    """The driver's result codes that these calls return; any other comes back as an int."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_STUB_LIBRARY = 34
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_MAP_FAILED = 205
    CUDA_ERROR_UNMAP_FAILED = 206
    CUDA_ERROR_ALREADY_MAPPED = 208
    CUDA_ERROR_NOT_MAPPED = 211
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
    CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0x0
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1
    CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0x0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
    CU_MEM_HANDLE_TYPE_WIN32 = 0x2
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4
    CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
    CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1


class CUipcMem_flags(enum.IntEnum):
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1


Result = CUresult | int
_RESULTS: dict[int, CUresult] = {int(m): m for m in CUresult}
_SUCCESS = 0


def _result(code: int) -> Result:
    return _RESULTS.get(code, code)


# --- structs (cuda.h layouts; C enums are int-sized) ---------------------------------------

_CUdeviceptr = ctypes.c_ulonglong  # typedef unsigned long long CUdeviceptr_v2 (LP64)
_CUhandle = ctypes.c_ulonglong  # typedef unsigned long long CUmemGenericAllocationHandle_v1
_IPC_HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE


class _Struct(ctypes.Structure):
    def getPtr(self) -> int:
        """The struct's address (the bindings' accessor of the same name)."""
        return ctypes.addressof(self)


class _CUmemLocation(_Struct):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(_Struct):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("_reserved", ctypes.c_ubyte * 4),  # not shown by the bindings (13.5)
    ]


class CUmemAllocationProp(_Struct):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class CUmemAccessDesc(_Struct):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(_Struct):
    """`char reserved[64]`; `reserved` reads all 64 bytes, as the bindings' does (a ctypes
    char array would stop at the first NUL)."""

    _fields_ = [("_reserved", ctypes.c_ubyte * _IPC_HANDLE_SIZE)]

    @property
    def reserved(self) -> bytes:
        return bytes(self._reserved)

    @reserved.setter
    def reserved(self, raw: bytes) -> None:
        if len(raw) != _IPC_HANDLE_SIZE:
            raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_SIZE} bytes, got {len(raw)}")
        ctypes.memmove(self._reserved, raw, _IPC_HANDLE_SIZE)


class CUuuid(_Struct):
    """`char bytes[16]`; `bytes` reads all 16 (a UUID may hold a zero byte)."""

    _fields_ = [("_bytes", ctypes.c_ubyte * 16)]

    @property
    def bytes(self) -> bytes:
        return bytes(self._bytes)


# --- symbols --------------------------------------------------------------------------------

_P = ctypes.POINTER
_size = ctypes.c_size_t
_uint = ctypes.c_uint
_ull = ctypes.c_ulonglong
_int = ctypes.c_int
_vp = ctypes.c_void_p

# symbol -> argtypes, from cuda.h's prototypes (CUresult, the return type, is an int enum).
PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "cuInit": (_uint,),  # (unsigned int Flags)
    "cuDeviceGet": (_P(_int), _int),  # (CUdevice *device, int ordinal)
    "cuDeviceGetCount": (_P(_int),),  # (int *count)
    "cuDeviceGetUuid_v2": (_P(CUuuid), _int),  # (CUuuid *uuid, CUdevice dev)
    "cuDevicePrimaryCtxRetain": (_P(_vp), _int),  # (CUcontext *pctx, CUdevice dev)
    "cuCtxSetCurrent": (_vp,),  # (CUcontext ctx)
    "cuCtxSynchronize": (),  # (void)
    "cuGetErrorName": (_int, _P(ctypes.c_char_p)),  # (CUresult error, const char **pStr)
    # (size_t *granularity, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags)
    "cuMemGetAllocationGranularity": (_P(_size), _P(CUmemAllocationProp), _int),
    # (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long)
    "cuMemAddressReserve": (_P(_CUdeviceptr), _size, _size, _CUdeviceptr, _ull),
    "cuMemAddressFree": (_CUdeviceptr, _size),  # (CUdeviceptr ptr, size_t size)
    # (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle, ull flags)
    "cuMemMap": (_CUdeviceptr, _size, _size, _CUhandle, _ull),
    "cuMemUnmap": (_CUdeviceptr, _size),  # (CUdeviceptr ptr, size_t size)
    # (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
    "cuMemSetAccess": (_CUdeviceptr, _size, _P(CUmemAccessDesc), _size),
    # (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *, ull)
    "cuMemCreate": (_P(_CUhandle), _size, _P(CUmemAllocationProp), _ull),
    "cuMemRelease": (_CUhandle,),  # (CUmemGenericAllocationHandle handle)
    # (void *shareableHandle, CUmemGenericAllocationHandle, CUmemAllocationHandleType, ull)
    "cuMemExportToShareableHandle": (_vp, _CUhandle, _int, _ull),
    # (CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType)
    "cuMemImportFromShareableHandle": (_P(_CUhandle), _vp, _int),
    # (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
    "cuMemcpyDtoDAsync_v2": (_CUdeviceptr, _CUdeviceptr, _size, _vp),
    "cuMemAlloc_v2": (_P(_CUdeviceptr), _size),  # (CUdeviceptr *dptr, size_t bytesize)
    "cuMemFree_v2": (_CUdeviceptr,),  # (CUdeviceptr dptr)
    "cuIpcGetMemHandle": (_P(CUipcMemHandle), _CUdeviceptr),  # (CUipcMemHandle *, CUdeviceptr)
    # (CUdeviceptr *pdptr, CUipcMemHandle handle (by value), unsigned int Flags)
    "cuIpcOpenMemHandle_v2": (_P(_CUdeviceptr), CUipcMemHandle, _uint),
    "cuIpcCloseMemHandle": (_CUdeviceptr,),  # (CUdeviceptr dptr)
}


class _Driver:
    """The bound symbols of one library object, as attributes named like the symbols."""

    def __init__(self, library: Any) -> None:
        for symbol, argtypes in PROTOTYPES.items():
            try:
                fn = getattr(library, symbol)
            except AttributeError as exc:
                raise LibcudaUnavailable(
                    f"{LIBRARY} lacks {symbol} (a driver older than CUDA 11.4?)"
                ) from exc
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            setattr(self, symbol, fn)


_lock = threading.Lock()
_driver: Any = None  # the _Driver once loaded


def load(library: Any = None) -> None:
    """Open libcuda.so.1 and bind every symbol, once; LibcudaUnavailable if it cannot.

    `library`, for tests: any object with the symbols as attributes (a `ctypes.CDLL`, or one of
    `ctypes.CFUNCTYPE` callbacks); it replaces what was bound before.
    """
    global _driver
    if library is None and _driver is not None:
        return
    with _lock:
        if library is None:
            if _driver is not None:
                return
            try:
                library = ctypes.CDLL(LIBRARY)
            except OSError as exc:
                raise LibcudaUnavailable(f"cannot open {LIBRARY}: {exc}") from exc
        _driver = _Driver(library)


def _d() -> Any:
    driver = _driver
    if driver is None:
        load()
        driver = _driver
    return driver


def _out(code: int, value: Any) -> tuple[Result, Any]:
    """(err, value), or (err, None) when the call failed: the bindings' convention."""
    return _result(code), (value if code == _SUCCESS else None)


# --- calls, with the bindings' signatures ---------------------------------------------------


def cuInit(Flags: int) -> tuple[Result]:
    return (_result(_d().cuInit(Flags)),)


def cuDeviceGet(ordinal: int) -> tuple[Result, int | None]:
    dev = ctypes.c_int()
    return _out(_d().cuDeviceGet(ctypes.byref(dev), ordinal), dev.value)


def cuDeviceGetCount() -> tuple[Result, int | None]:
    count = ctypes.c_int()
    return _out(_d().cuDeviceGetCount(ctypes.byref(count)), count.value)


def cuDeviceGetUuid(dev: int) -> tuple[Result, CUuuid | None]:
    """cuDeviceGetUuid_v2 (see the module's docstring); the UUID's 16 bytes are `.bytes`."""
    uuid = CUuuid()
    return _out(_d().cuDeviceGetUuid_v2(ctypes.byref(uuid), dev), uuid)


def cuDevicePrimaryCtxRetain(dev: int) -> tuple[Result, int | None]:
    ctx = ctypes.c_void_p()
    return _out(_d().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), ctx.value or 0)


def cuCtxSetCurrent(ctx: int | None) -> tuple[Result]:
    return (_result(_d().cuCtxSetCurrent(ctx)),)


def cuCtxSynchronize() -> tuple[Result]:
    return (_result(_d().cuCtxSynchronize()),)


def cuGetErrorName(error: int) -> tuple[Result, bytes | None]:
    name = ctypes.c_char_p()
    return _out(_d().cuGetErrorName(int(error), ctypes.byref(name)), name.value)


def cuMemGetAllocationGranularity(
    prop: CUmemAllocationProp, option: int
) -> tuple[Result, int | None]:
    granularity = ctypes.c_size_t()
    code = _d().cuMemGetAllocationGranularity(
        ctypes.byref(granularity), ctypes.byref(prop), option
    )
    return _out(code, granularity.value)


def cuMemAddressReserve(
    size: int, alignment: int, addr: int, flags: int
) -> tuple[Result, int | None]:
    ptr = _CUdeviceptr()
    return _out(_d().cuMemAddressReserve(ctypes.byref(ptr), size, alignment, addr, flags),
                ptr.value)


def cuMemAddressFree(ptr: int, size: int) -> tuple[Result]:
    return (_result(_d().cuMemAddressFree(ptr, size)),)


def cuMemMap(ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[Result]:
    return (_result(_d().cuMemMap(ptr, size, offset, handle, flags)),)


def cuMemUnmap(ptr: int, size: int) -> tuple[Result]:
    return (_result(_d().cuMemUnmap(ptr, size)),)


def cuMemSetAccess(
    ptr: int, size: int, desc: Sequence[CUmemAccessDesc], count: int
) -> tuple[Result]:
    """`desc`: a list of CUmemAccessDesc, the first `count` of which are passed."""
    descs = list(desc)
    if count > len(descs):
        raise RuntimeError(f"List is too small: {len(descs)} < {count}")
    array = (CUmemAccessDesc * count)(*descs[:count]) if count else None
    return (_result(_d().cuMemSetAccess(ptr, size, array, count)),)


def cuMemCreate(size: int, prop: CUmemAllocationProp, flags: int) -> tuple[Result, int | None]:
    handle = _CUhandle()
    return _out(_d().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), flags),
                handle.value)


def cuMemRelease(handle: int) -> tuple[Result]:
    return (_result(_d().cuMemRelease(handle)),)


def cuMemExportToShareableHandle(
    handle: int, handleType: int, flags: int
) -> tuple[Result, int | None]:
    """The allocation as a POSIX fd (the only handle type bound: cuda.h documents it as an
    `int` written to `*shareableHandle`)."""
    if handleType != CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        raise NotImplementedError(f"only POSIX file descriptors are bound, not {handleType!r}")
    fd = ctypes.c_int(-1)
    code = _d().cuMemExportToShareableHandle(ctypes.byref(fd), handle, handleType, flags)
    return _out(code, fd.value)


def cuMemImportFromShareableHandle(osHandle: int, shHandleType: int) -> tuple[Result, int | None]:
    """`osHandle`: the fd, passed as the pointer's value, as cuda.h's users do:
    `(void *)(uintptr_t)fd` (NVIDIA's cuda-samples, memMapIPCDrv/memMapIpc.cpp)."""
    handle = _CUhandle()
    code = _d().cuMemImportFromShareableHandle(ctypes.byref(handle), osHandle, shHandleType)
    return _out(code, handle.value)


def cuMemcpyDtoDAsync(
    dstDevice: int, srcDevice: int, ByteCount: int, hStream: int | None
) -> tuple[Result]:
    """cuMemcpyDtoDAsync_v2; `hStream`: a CUstream's address (torch's `cuda_stream`), 0 for the
    legacy default stream."""
    return (_result(_d().cuMemcpyDtoDAsync_v2(dstDevice, srcDevice, ByteCount, hStream)),)


def cuMemAlloc(bytesize: int) -> tuple[Result, int | None]:
    """cuMemAlloc_v2."""
    ptr = _CUdeviceptr()
    return _out(_d().cuMemAlloc_v2(ctypes.byref(ptr), bytesize), ptr.value)


def cuMemFree(dptr: int) -> tuple[Result]:
    """cuMemFree_v2."""
    return (_result(_d().cuMemFree_v2(dptr)),)


def cuIpcGetMemHandle(dptr: int) -> tuple[Result, CUipcMemHandle | None]:
    handle = CUipcMemHandle()
    return _out(_d().cuIpcGetMemHandle(ctypes.byref(handle), dptr), handle)


def cuIpcOpenMemHandle(handle: CUipcMemHandle, Flags: int) -> tuple[Result, int | None]:
    """cuIpcOpenMemHandle_v2; the handle goes by value, as in cuda.h."""
    ptr = _CUdeviceptr()
    return _out(_d().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, Flags), ptr.value)


def cuIpcCloseMemHandle(dptr: int) -> tuple[Result]:
    return (_result(_d().cuIpcCloseMemHandle(dptr)),)
