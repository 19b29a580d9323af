"""The ctypes driver binding (`native/shared/_libcuda.py`) and its choice (`cudadriver`), without
a GPU.

What is checked: the structs' layouts and the enums' values against cuda.h (CUDA 13.0's
`include/cuda.h`: CUmemAllocationProp_st, CUmemAccessDesc_st, CUmemLocation_st,
CUipcMemHandle_st, CUuuid_st and the enums beside them), and against cuda-bindings where it
is importable; the bindings' calling convention (result tuples, outputs, `(err, None)` on
failure); how a missing libcuda fails; and that the project's own callers (`_cuda`,
`cuda_vmm`, `cuda_ipc`, `gpu`) run unchanged over this module. For the last two a stand-in
driver replaces libcuda: each symbol is a C callback (`ctypes.CFUNCTYPE`) declared here with
cuda.h's prototype, independently of the module's own argtypes, so the arguments cross a real
C call and a wrong argtype shows as a truncated or misread value.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from weightcache.native.shared import _libcuda as lc
from weightcache.testing.processes import run_without_cuda_python

# --- cuda.h's layouts (LP64) ---------------------------------------------------------------


def test_alloc_prop_layout_is_cuda_h():
    # CUmemAllocationProp_st: CUmemAllocationType type (int, @0); CUmemAllocationHandleType
    # requestedHandleTypes (@4); CUmemLocation location {type @8, id @12}; void
    # *win32HandleMetaData (8-aligned, @16); struct allocFlags {uchar compressionType @24,
    # uchar gpuDirectRDMACapable @25, ushort usage @26, uchar reserved[4] @28}: 32 bytes.
    P = lc.CUmemAllocationProp
    assert ctypes.sizeof(P) == 32
    assert ctypes.alignment(P) == 8
    assert [(name, getattr(P, name).offset) for name, _ in P._fields_] == [
        ("type", 0),
        ("requestedHandleTypes", 4),
        ("location", 8),
        ("win32HandleMetaData", 16),
        ("allocFlags", 24),
    ]
    loc = type(P().location)
    assert ctypes.sizeof(loc) == 8
    assert (loc.type.offset, loc.id.offset) == (0, 4)
    flags = type(P().allocFlags)
    assert ctypes.sizeof(flags) == 8
    assert [getattr(flags, n).offset for n, _ in flags._fields_] == [0, 1, 2, 4]
    assert [getattr(flags, n).size for n, _ in flags._fields_] == [1, 1, 2, 4]


def test_alloc_prop_bytes_match_a_packed_reading():
    prop = lc.CUmemAllocationProp()
    prop.type = lc.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    fd_type = lc.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.requestedHandleTypes = fd_type
    prop.location.type = lc.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE  # nested assignment
    prop.location.id = 7
    prop.win32HandleMetaData = 0x1122334455667788
    prop.allocFlags.compressionType = 0xA1
    prop.allocFlags.gpuDirectRDMACapable = 0xB2
    prop.allocFlags.usage = 0xC3D4
    raw = ctypes.string_at(prop.getPtr(), 32)
    assert raw == bytes(prop)
    assert struct.unpack("<iiiiQBBH4s", raw) == (
        1, 1, 1, 7, 0x1122334455667788, 0xA1, 0xB2, 0xC3D4, b"\0\0\0\0"
    )
    assert prop.location.type == lc.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE


def test_access_desc_ipc_handle_and_uuid_layouts():
    # CUmemAccessDesc_st: CUmemLocation location (@0, 8 bytes); CUmemAccess_flags flags (@8).
    assert ctypes.sizeof(lc.CUmemAccessDesc) == 12
    assert (lc.CUmemAccessDesc.location.offset, lc.CUmemAccessDesc.flags.offset) == (0, 8)
    desc = lc.CUmemAccessDesc()
    desc.location.type = 1
    desc.location.id = 3
    desc.flags = lc.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    assert struct.unpack("<iii", bytes(desc)) == (1, 3, 1)
    # CUipcMemHandle_st: char reserved[CU_IPC_HANDLE_SIZE = 64]; CUuuid_st: char bytes[16].
    assert ctypes.sizeof(lc.CUipcMemHandle) == 64
    assert ctypes.sizeof(lc.CUuuid) == 16


def test_ipc_handle_and_uuid_read_every_byte():
    raw = b"\0" + bytes(range(1, 64))  # a leading NUL: a c_char array would read b""
    handle = lc.CUipcMemHandle()
    ctypes.memmove(int(handle.getPtr()), raw, 64)  # how cuda_ipc._handle_from fills one
    assert ctypes.string_at(int(handle.getPtr()), 64) == raw
    assert handle.reserved == raw
    handle.reserved = bytes(64)
    assert bytes(handle) == bytes(64)
    with pytest.raises(ValueError):
        handle.reserved = b"short"
    uuid = lc.CUuuid()
    ctypes.memmove(uuid.getPtr(), bytes(16), 16)
    assert uuid.bytes == bytes(16) and isinstance(uuid.bytes, bytes)


def test_enum_values_are_cuda_h():
    assert lc.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 1
    assert lc.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_WIN32 == 2
    assert lc.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_WIN32_KMT == 4
    assert lc.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED == 1
    assert lc.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE == 1
    assert lc.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE == 0
    assert lc.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ == 1
    assert lc.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE == 3
    assert lc.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM == 0
    assert lc.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED == 1
    assert lc.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS == 1
    R = lc.CUresult
    assert (R.CUDA_SUCCESS, R.CUDA_ERROR_INVALID_VALUE, R.CUDA_ERROR_OUT_OF_MEMORY) == (0, 1, 2)
    assert (R.CUDA_ERROR_NOT_INITIALIZED, R.CUDA_ERROR_NO_DEVICE) == (3, 100)
    assert (R.CUDA_ERROR_INVALID_DEVICE, R.CUDA_ERROR_INVALID_CONTEXT) == (101, 201)
    assert (R.CUDA_ERROR_INVALID_HANDLE, R.CUDA_ERROR_NOT_PERMITTED) == (400, 800)
    assert (R.CUDA_ERROR_NOT_SUPPORTED, R.CUDA_ERROR_UNKNOWN) == (801, 999)


def test_the_symbols_are_the_versioned_ones():
    # cuda.h: #define cuMemAlloc cuMemAlloc_v2, cuMemFree cuMemFree_v2, cuMemcpyDtoDAsync
    # __CUDA_API_PTSZ(cuMemcpyDtoDAsync_v2), cuIpcOpenMemHandle cuIpcOpenMemHandle_v2,
    # cuDeviceGetUuid cuDeviceGetUuid_v2 (13.0). The plain names are the 32-bit v1 ABI.
    symbols = set(lc.PROTOTYPES)
    for v2 in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyDtoDAsync_v2",
               "cuIpcOpenMemHandle_v2", "cuDeviceGetUuid_v2"):
        assert v2 in symbols
        assert v2.removesuffix("_v2") not in symbols
    assert len(symbols) == 24


# --- against cuda-bindings, where importable ---------------------------------------------

ENUMS = [lc.CUresult, lc.CUmemAllocationType, lc.CUmemLocationType,
         lc.CUmemAllocationHandleType, lc.CUmemAccess_flags,
         lc.CUmemAllocationGranularity_flags, lc.CUipcMem_flags]
CALLS = [name for name in dir(lc) if name.startswith("cu") and callable(getattr(lc, name))]


def _bindings():
    return pytest.importorskip(
        "cuda.bindings.driver",
        reason="no cuda-python here: test_against_the_real_bindings_in_a_child runs this")


BINDINGS_ENV = "WEIGHTCACHE_CUDA_BINDINGS_DIR"
BINDINGS_DIR = os.environ.get(BINDINGS_ENV) or os.path.join(
    os.path.dirname(__file__), "..", "..", ".venv", "cuda-bindings")


def test_against_the_real_bindings_in_a_child():
    """The tests marked `bindings`, in a child whose path has cuda-python's bindings
    (`make cuda-bindings`: the GPU machines' version, in a folder of its own). Not in this
    process: with them importable, torch >= 2.13 imports them in `import torch`, and they run
    `ldconfig -p` then, which test_import_set.py checks no rank or engine import does."""
    if os.environ.get("WEIGHTCACHE_IN_BINDINGS_CHILD"):
        pytest.skip("this is the child")
    if not os.path.isdir(os.path.join(BINDINGS_DIR, "cuda", "bindings")):
        why = f"cuda-python's bindings are not installed in {BINDINGS_DIR} (make cuda-bindings)"
        if os.environ.get("WEIGHTCACHE_REQUIRE_CUDA_BINDINGS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env = {**os.environ, "WEIGHTCACHE_IN_BINDINGS_CHILD": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.abspath(BINDINGS_DIR),
                                                     os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-m", "bindings", "-rs", __file__],
                         env=env, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    marked = sum(1 for name, fn in globals().items() if name.startswith("test_")
                 and any(m.name == "bindings" for m in getattr(fn, "pytestmark", [])))
    assert marked >= 7
    assert summary.startswith(f"{marked} passed") and "skipped" not in summary, out.stdout


@pytest.mark.bindings
def test_enums_match_the_bindings():
    cu = _bindings()
    for ours in ENUMS:
        theirs = getattr(cu, ours.__name__)
        for member in ours:
            assert int(getattr(theirs, member.name)) == int(member), (ours.__name__, member)


@pytest.mark.bindings
def test_calls_and_struct_attributes_match_the_bindings():
    cu = _bindings()
    assert len(CALLS) == 24
    missing = [name for name in CALLS if not hasattr(cu, name)]
    assert missing == []

    def public(obj: Any) -> set[str]:
        return {n for n in dir(obj) if not n.startswith("_")}

    # Every attribute of ours is the bindings' of the same name (what the callers, written
    # for the bindings, use). The bindings may have more: CUmemLocation's `localized` (13.5,
    # a union with `id` that leaves the layout as it was: test_struct_bytes_match_the_bindings).
    # Ours has one more: the IPC handle's `reserved`, which cuda-bindings 13.3 shows and 13.5
    # no longer does (cuda_ipc.py reads the handle through getPtr(), which both have).
    for name in ("CUmemAllocationProp", "CUmemAccessDesc", "CUipcMemHandle", "CUuuid"):
        ours = public(getattr(lc, name)()) - ({"reserved"} if name == "CUipcMemHandle" else set())
        assert ours <= public(getattr(cu, name)()), name
    ours, theirs = lc.CUmemAllocationProp(), cu.CUmemAllocationProp()
    assert public(ours.location) <= public(theirs.location)
    assert public(ours.allocFlags) <= public(theirs.allocFlags)
    assert public(lc.CUmemAccessDesc().location) <= public(cu.CUmemAccessDesc().location)


@pytest.mark.bindings
def test_struct_bytes_match_the_bindings():
    cu = _bindings()
    pairs = []
    for mod in (lc, cu):
        prop = mod.CUmemAllocationProp()
        prop.type = mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = (
            mod.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        prop.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0x01020304
        prop.win32HandleMetaData = 0x1122334455667788
        prop.allocFlags.compressionType = 0x11
        prop.allocFlags.gpuDirectRDMACapable = 0x22
        prop.allocFlags.usage = 0x3344
        desc = mod.CUmemAccessDesc()
        desc.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = 5
        desc.flags = mod.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        pairs.append((ctypes.string_at(int(prop.getPtr()), 32),
                      ctypes.string_at(int(desc.getPtr()), 12)))
    assert pairs[0] == pairs[1]


# --- loading ------------------------------------------------------------------------------


def test_no_library_fails_with_the_documented_error(monkeypatch):
    monkeypatch.setattr(lc, "_driver", None)
    monkeypatch.setattr(lc, "LIBRARY", "libcuda-not-here.so.1")
    with pytest.raises(lc.LibcudaUnavailable, match="libcuda-not-here"):
        lc.load()
    assert issubclass(lc.LibcudaUnavailable, ImportError)
    with pytest.raises(ImportError):  # a call before load() loads, and fails the same way
        lc.cuInit(0)
    assert lc._driver is None


def test_this_machines_libcuda(monkeypatch):
    """Where libcuda.so.1 cannot be opened (CI, this dev box) load() raises; where it can (a
    GPU node), every symbol bound here exists in it."""
    monkeypatch.setattr(lc, "_driver", None)
    try:
        ctypes.CDLL(lc.LIBRARY)
    except OSError:
        with pytest.raises(lc.LibcudaUnavailable, match="cannot open"):
            lc.load()
        return
    lc.load()
    assert lc._driver is not None


def test_a_missing_symbol_fails_load(monkeypatch):
    fake = FakeDriver()
    del fake.cuDeviceGetUuid_v2
    monkeypatch.setattr(lc, "_driver", None)
    with pytest.raises(lc.LibcudaUnavailable, match="cuDeviceGetUuid_v2"):
        lc.load(fake)
    assert lc._driver is None


def test_import_opens_nothing():
    code = textwrap.dedent(
        """
        import ctypes

        def refuse(*args, **kwargs):
            raise AssertionError("opened a library at import")
        import weightcache.native.shared.transport  # its package imports torch, which opens libs
        ctypes.CDLL = refuse
        from weightcache.native.shared import _libcuda
        assert _libcuda._driver is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- a stand-in libcuda -------------------------------------------------------------------

c_int, c_uint, c_size_t, c_ull, c_void_p = (
    ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_void_p)
P = ctypes.POINTER


class IpcHandle(ctypes.Structure):  # CUipcMemHandle_st, declared apart from the module's
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


# cuda.h's prototypes (CUdevice int, CUcontext/CUstream pointers, CUdeviceptr and
# CUmemGenericAllocationHandle unsigned long long, structs by address as void *).
C_PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "cuInit": (c_uint,),
    "cuDeviceGet": (P(c_int), c_int),
    "cuDeviceGetCount": (P(c_int),),
    "cuDeviceGetUuid_v2": (c_void_p, c_int),
    "cuDevicePrimaryCtxRetain": (P(c_void_p), c_int),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxSynchronize": (),
    "cuGetErrorName": (c_int, P(ctypes.c_char_p)),
    "cuMemGetAllocationGranularity": (P(c_size_t), c_void_p, c_int),
    "cuMemAddressReserve": (P(c_ull), c_size_t, c_size_t, c_ull, c_ull),
    "cuMemAddressFree": (c_ull, c_size_t),
    "cuMemMap": (c_ull, c_size_t, c_size_t, c_ull, c_ull),
    "cuMemUnmap": (c_ull, c_size_t),
    "cuMemSetAccess": (c_ull, c_size_t, c_void_p, c_size_t),
    "cuMemCreate": (P(c_ull), c_size_t, c_void_p, c_ull),
    "cuMemRelease": (c_ull,),
    "cuMemExportToShareableHandle": (c_void_p, c_ull, c_int, c_ull),
    "cuMemImportFromShareableHandle": (P(c_ull), c_void_p, c_int),
    "cuMemcpyDtoDAsync_v2": (c_ull, c_ull, c_size_t, c_void_p),
    "cuMemAlloc_v2": (P(c_ull), c_size_t),
    "cuMemFree_v2": (c_ull,),
    "cuIpcGetMemHandle": (c_void_p, c_ull),
    "cuIpcOpenMemHandle_v2": (P(c_ull), IpcHandle, c_uint),
    "cuIpcCloseMemHandle": (c_ull,),
}

GIB = 1 << 30
GRANULE = 5 * GIB  # over 2**32: a size squeezed through 32 bits shows
VA_BASE = 0x7F12_3456_0000  # device addresses over 2**32
ALLOC_BASE = 0x7E00_0000_0000
HANDLE_BASE = 0xFEED_0000_0000_0000  # allocation handles using all 64 bits
CTX_BASE = 0xC0DE_0000
IPC_RAW = b"\0\x01" + bytes(range(2, 64))  # NULs first, as real handles may have
NAMES = {1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY"}


def _prop(addr: int) -> tuple[int, ...]:
    """A CUmemAllocationProp read with cuda.h's offsets, not the module's Structure."""
    return struct.unpack("<iiiiQBBH4s", ctypes.string_at(addr, 32))


class FakeDriver:
    """libcuda's symbols as C callbacks; `calls` records what crossed, `fail[symbol] = code`
    makes a symbol fail without writing its outputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, int] = {}
        self.errors: list[str] = []
        self.exported: list[int] = []
        self._handles = 0
        for symbol, argtypes in C_PROTOTYPES.items():
            impl = getattr(self, "_" + symbol)
            setattr(self, symbol, ctypes.CFUNCTYPE(c_int, *argtypes)(self._guard(symbol, impl)))

    def _guard(self, symbol: str, impl: Any) -> Any:
        def call(*args: Any) -> int:
            if symbol in self.fail:
                self.calls.append((symbol, "failed"))
                return self.fail[symbol]
            try:
                return impl(*args)
            except Exception as exc:  # a callback cannot raise into C; the test checks errors
                self.errors.append(f"{symbol}: {exc!r}")
                return 999
        return call

    def of(self, symbol: str) -> list[tuple[Any, ...]]:
        return [c[1:] for c in self.calls if c[0] == symbol]

    def _cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return 0

    def _cuDeviceGet(self, out, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        out[0] = 100 + ordinal
        return 0

    def _cuDeviceGetCount(self, out):
        out[0] = 2
        return 0

    def _cuDeviceGetUuid_v2(self, out, dev):
        self.calls.append(("cuDeviceGetUuid_v2", dev))
        ctypes.memmove(out, bytes([0, dev & 0xFF]) + bytes(range(2, 16)), 16)
        return 0

    def _cuDevicePrimaryCtxRetain(self, out, dev):
        self.calls.append(("cuDevicePrimaryCtxRetain", dev))
        out[0] = CTX_BASE + dev
        return 0

    def _cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", ctx))
        return 0

    def _cuCtxSynchronize(self):
        self.calls.append(("cuCtxSynchronize",))
        return 0

    def _cuGetErrorName(self, code, out):
        if code not in NAMES:
            return 1  # CUDA_ERROR_INVALID_VALUE, *pStr left NULL
        out[0] = NAMES[code]  # NAMES keeps the bytes alive
        return 0

    def _cuMemGetAllocationGranularity(self, out, prop, option):
        self.calls.append(("cuMemGetAllocationGranularity", _prop(prop), option))
        out[0] = GRANULE if option == 1 else 2 << 20
        return 0

    def _cuMemAddressReserve(self, out, size, alignment, addr, flags):
        self.calls.append(("cuMemAddressReserve", size, alignment, addr, flags))
        out[0] = VA_BASE
        return 0

    def _cuMemAddressFree(self, ptr, size):
        self.calls.append(("cuMemAddressFree", ptr, size))
        return 0

    def _cuMemMap(self, ptr, size, offset, handle, flags):
        self.calls.append(("cuMemMap", ptr, size, offset, handle, flags))
        return 0

    def _cuMemUnmap(self, ptr, size):
        self.calls.append(("cuMemUnmap", ptr, size))
        return 0

    def _cuMemSetAccess(self, ptr, size, desc, count):
        descs = [struct.unpack("<iii", ctypes.string_at(desc + 12 * i, 12))
                 for i in range(count)] if desc else []
        self.calls.append(("cuMemSetAccess", ptr, size, descs, count))
        return 0

    def _cuMemCreate(self, out, size, prop, flags):
        self.calls.append(("cuMemCreate", size, _prop(prop), flags))
        out[0] = HANDLE_BASE + self._handles
        self._handles += 1
        return 0

    def _cuMemRelease(self, handle):
        self.calls.append(("cuMemRelease", handle))
        return 0

    def _cuMemExportToShareableHandle(self, out, handle, kind, flags):
        self.calls.append(("cuMemExportToShareableHandle", handle, kind, flags))
        r, w = os.pipe()
        os.close(w)
        self.exported.append(r)
        ctypes.cast(out, P(c_int))[0] = r  # an int, for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return 0

    def _cuMemImportFromShareableHandle(self, out, os_handle, kind):
        self.calls.append(("cuMemImportFromShareableHandle", os_handle or 0, kind))
        out[0] = HANDLE_BASE + 0x1000 + (os_handle or 0)
        return 0

    def _cuMemcpyDtoDAsync_v2(self, dst, src, n, stream):
        self.calls.append(("cuMemcpyDtoDAsync_v2", dst, src, n, stream or 0))
        return 0

    def _cuMemAlloc_v2(self, out, size):
        self.calls.append(("cuMemAlloc_v2", size))
        out[0] = ALLOC_BASE
        return 0

    def _cuMemFree_v2(self, ptr):
        self.calls.append(("cuMemFree_v2", ptr))
        return 0

    def _cuIpcGetMemHandle(self, out, ptr):
        self.calls.append(("cuIpcGetMemHandle", ptr))
        ctypes.memmove(out, IPC_RAW, 64)
        return 0

    def _cuIpcOpenMemHandle_v2(self, out, handle, flags):
        self.calls.append(("cuIpcOpenMemHandle_v2", bytes(handle.reserved), flags))
        out[0] = VA_BASE + 0x100
        return 0

    def _cuIpcCloseMemHandle(self, ptr):
        self.calls.append(("cuIpcCloseMemHandle", ptr))
        return 0


@pytest.fixture
def fake(monkeypatch) -> Any:
    driver = FakeDriver()
    monkeypatch.setattr(lc, "_driver", None)  # restored (to unloaded) after the test
    lc.load(driver)
    yield driver
    assert driver.errors == []


SUCCESS = lc.CUresult.CUDA_SUCCESS


def test_result_tuples_follow_the_bindings(fake):
    assert lc.cuInit(0) == (SUCCESS,)
    assert type(lc.cuInit(0)[0]) is lc.CUresult
    assert lc.cuCtxSynchronize() == (SUCCESS,)
    assert lc.cuDeviceGet(3) == (SUCCESS, 103)
    assert lc.cuDeviceGetCount() == (SUCCESS, 2)
    err, uuid = lc.cuDeviceGetUuid(5)
    assert err == SUCCESS and uuid.bytes == bytes([0, 5]) + bytes(range(2, 16))
    assert lc.cuDevicePrimaryCtxRetain(1) == (SUCCESS, CTX_BASE + 1)
    assert lc.cuGetErrorName(lc.CUresult.CUDA_ERROR_OUT_OF_MEMORY) == (
        SUCCESS, b"CUDA_ERROR_OUT_OF_MEMORY")
    assert lc.cuGetErrorName(12345) == (lc.CUresult.CUDA_ERROR_INVALID_VALUE, None)
    assert lc.cuMemAlloc(6 * GIB) == (SUCCESS, ALLOC_BASE)
    assert fake.of("cuMemAlloc_v2") == [(6 * GIB,)]
    assert lc.cuMemFree(ALLOC_BASE) == (SUCCESS,)
    assert fake.of("cuMemFree_v2") == [(ALLOC_BASE,)]


def test_a_failed_call_returns_none_and_keeps_unknown_codes(fake):
    fake.fail["cuMemCreate"] = 2
    err, handle = lc.cuMemCreate(GRANULE, lc.CUmemAllocationProp(), 0)
    assert (err, handle) == (lc.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    assert type(err) is lc.CUresult
    fake.fail["cuMemMap"] = 12345  # a code newer than this module
    (err,) = lc.cuMemMap(VA_BASE, GRANULE, 0, HANDLE_BASE, 0)
    assert err == 12345 and type(err) is int and err != SUCCESS
    fake.fail["cuDeviceGet"] = 101
    assert lc.cuDeviceGet(0) == (lc.CUresult.CUDA_ERROR_INVALID_DEVICE, None)


def test_arguments_cross_at_full_width(fake):
    big = 5 * GIB + 4096
    assert lc.cuMemAddressReserve(big, 2 << 20, VA_BASE, 0) == (SUCCESS, VA_BASE)
    assert fake.of("cuMemAddressReserve") == [(big, 2 << 20, VA_BASE, 0)]
    assert lc.cuMemMap(VA_BASE, big, GRANULE, HANDLE_BASE + 7, 0) == (SUCCESS,)
    assert fake.of("cuMemMap") == [(VA_BASE, big, GRANULE, HANDLE_BASE + 7, 0)]
    assert lc.cuMemcpyDtoDAsync(VA_BASE + 1, ALLOC_BASE + 2, big, 0xABCD00) == (SUCCESS,)
    assert lc.cuMemcpyDtoDAsync(VA_BASE, ALLOC_BASE, 1, 0) == (SUCCESS,)
    assert fake.of("cuMemcpyDtoDAsync_v2") == [
        (VA_BASE + 1, ALLOC_BASE + 2, big, 0xABCD00), (VA_BASE, ALLOC_BASE, 1, 0)]
    assert lc.cuMemUnmap(VA_BASE, big) == (SUCCESS,)
    assert lc.cuMemAddressFree(VA_BASE, big) == (SUCCESS,)
    assert fake.of("cuMemAddressFree") == [(VA_BASE, big)]


def test_set_access_takes_a_list_of_descs(fake):
    descs = []
    for dev, flags in ((0, 3), (2, 1)):
        desc = lc.CUmemAccessDesc()
        desc.location.type = lc.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = dev
        desc.flags = flags
        descs.append(desc)
    assert lc.cuMemSetAccess(VA_BASE, GRANULE, descs, 2) == (SUCCESS,)
    assert lc.cuMemSetAccess(VA_BASE, GRANULE, descs, 1) == (SUCCESS,)
    assert lc.cuMemSetAccess(VA_BASE, GRANULE, [], 0) == (SUCCESS,)
    assert fake.of("cuMemSetAccess") == [
        (VA_BASE, GRANULE, [(1, 0, 3), (1, 2, 1)], 2),
        (VA_BASE, GRANULE, [(1, 0, 3)], 1),
        (VA_BASE, GRANULE, [], 0),
    ]
    with pytest.raises(RuntimeError, match="too small"):
        lc.cuMemSetAccess(VA_BASE, GRANULE, descs, 3)


def test_shareable_handles_are_fds(fake):
    fd_type = lc.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    err, fd = lc.cuMemExportToShareableHandle(HANDLE_BASE + 3, fd_type, 0)
    assert err == SUCCESS and fd == fake.exported[-1] and isinstance(fd, int)
    os.close(fd)
    assert fake.of("cuMemExportToShareableHandle") == [(HANDLE_BASE + 3, 1, 0)]
    with pytest.raises(NotImplementedError):
        lc.cuMemExportToShareableHandle(HANDLE_BASE, 2, 0)
    # (void *)(uintptr_t)fd: the fd is the pointer's value, fd 0 included
    assert lc.cuMemImportFromShareableHandle(9, fd_type) == (SUCCESS, HANDLE_BASE + 0x1009)
    assert lc.cuMemImportFromShareableHandle(0, fd_type) == (SUCCESS, HANDLE_BASE + 0x1000)
    assert fake.of("cuMemImportFromShareableHandle") == [(9, 1), (0, 1)]
    assert lc.cuMemRelease(HANDLE_BASE + 0x1009) == (SUCCESS,)
    assert fake.of("cuMemRelease") == [(HANDLE_BASE + 0x1009,)]


def test_ipc_handle_goes_by_value(fake):
    err, handle = lc.cuIpcGetMemHandle(ALLOC_BASE)
    assert err == SUCCESS and handle.reserved == IPC_RAW
    flags = lc.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    assert lc.cuIpcOpenMemHandle(handle, flags) == (SUCCESS, VA_BASE + 0x100)
    assert fake.of("cuIpcOpenMemHandle_v2") == [(IPC_RAW, 1)]
    assert lc.cuIpcCloseMemHandle(VA_BASE + 0x100) == (SUCCESS,)


# --- the project's callers, unchanged, over this module ----------------------------------


@pytest.fixture
def callers(monkeypatch, fake) -> Any:
    """`WEIGHTCACHE_CUDA_DRIVER=ctypes`: `_cuda.driver()` and gpu.py's `_driver()` choose this
    module (loaded over the stand-in) through `cudadriver`, as on a GPU node; no device UUID
    query for an arena (torch's would need a GPU)."""
    from weightcache.native.shared import cudadriver
    from weightcache.native.shared.transport import _cuda

    monkeypatch.setenv(cudadriver.DRIVER_ENV, cudadriver.CTYPES)
    cudadriver.forget()
    assert _cuda.driver() is lc
    monkeypatch.setattr(_cuda, "_primary", {})
    monkeypatch.setattr(_cuda, "device_uuid", lambda ordinal: f"GPU-fake-{ordinal}")
    errors_before = list(_cuda.RELEASE_ERRORS)
    yield fake
    cudadriver.forget()
    assert list(_cuda.RELEASE_ERRORS) == errors_before


def test_check_and_error_name_over_this_module(callers):
    from weightcache.native.shared.transport import _cuda

    assert _cuda.check(lc.cuInit(0), "cuInit") is None
    assert _cuda.check(lc.cuMemAlloc(10), "cuMemAlloc") == ALLOC_BASE
    callers.fail["cuMemAlloc_v2"] = 2
    with pytest.raises(_cuda.CudaCallError, match="cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        _cuda.check(lc.cuMemAlloc(10), "cuMemAlloc")
    assert _cuda.error_name(777) == "777"  # the driver has no name for it


def test_make_current_retains_once(callers):
    from weightcache.native.shared.transport import _cuda

    _cuda.make_current(2)
    _cuda.make_current(2)
    assert callers.of("cuInit") == [(0,)]
    assert callers.of("cuDeviceGet") == [(2,)]
    assert callers.of("cuDevicePrimaryCtxRetain") == [(102,)]
    assert callers.of("cuCtxSetCurrent") == [(CTX_BASE + 102,), (CTX_BASE + 102,)]


def test_gpu_uuid_over_this_module(callers):
    from weightcache.native.shared import gpu

    expect = gpu.uuid_from_bytes(bytes([0, 101]) + bytes(range(2, 16)))
    assert gpu._driver_uuid(1) == expect
    assert gpu.visible_device_uuids() == [
        gpu.uuid_from_bytes(bytes([0, 100]) + bytes(range(2, 16))), expect]
    callers.fail["cuInit"] = 100
    assert gpu.visible_device_uuids() is None
    with pytest.raises(gpu.GpuError, match="cuInit failed"):
        gpu._driver_uuid(0)


def test_vmm_arena_export_and_import_over_this_module(callers):
    from weightcache.native.shared.transport import cuda_vmm

    fd_type, pinned, device = 1, 1, 1
    arena = cuda_vmm.VmmArena(6 * GIB, 1, count=2)
    assert arena.sizes == [GRANULE, GRANULE]
    props = [c[0] for c in callers.of("cuMemGetAllocationGranularity")]
    assert props and all(p[:4] == (pinned, fd_type, device, 1) for p in props)
    assert callers.of("cuMemCreate") == [(GRANULE, props[0], 0)] * 2
    assert callers.of("cuMemAddressReserve") == [(2 * GRANULE, 0, 0, 0)]
    assert callers.of("cuMemMap") == [(VA_BASE, GRANULE, 0, HANDLE_BASE, 0),
                                      (VA_BASE + GRANULE, GRANULE, 0, HANDLE_BASE + 1, 0)]
    assert callers.of("cuMemSetAccess") == [(VA_BASE, GRANULE, [(device, 1, 3)], 1),
                                            (VA_BASE + GRANULE, GRANULE, [(device, 1, 3)], 1)]
    meta, fds = arena.export()
    assert fds == callers.exported and meta["pieces"] == [GRANULE, GRANULE]
    assert callers.of("cuMemExportToShareableHandle") == [(HANDLE_BASE, fd_type, 0),
                                                          (HANDLE_BASE + 1, fd_type, 0)]
    sent = [os.dup(fd) for fd in fds]  # what SCM_RIGHTS would hand the client

    client = cuda_vmm.VmmImported(meta, sent, 1, readonly=True)
    client._map_rest()  # what tensor() maps before its (GPU-only) torch view
    assert callers.of("cuMemImportFromShareableHandle") == [(fd, fd_type) for fd in sent]
    access = callers.of("cuMemSetAccess")[2:]
    assert [a[2] for a in access] == [[(device, 1, 1)], [(device, 1, 1)]]  # PROT_READ
    for fd in sent:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed once imported
    client.close()  # the range goes with the last reference: unmapped and freed
    assert callers.of("cuMemAddressFree")[-1:] == [(VA_BASE, 2 * GRANULE)]

    arena.close()
    assert callers.of("cuMemRelease")[-2:] == [(HANDLE_BASE + 1,), (HANDLE_BASE,)]
    assert callers.of("cuMemUnmap")[-2:] == [(VA_BASE + GRANULE, GRANULE), (VA_BASE, GRANULE)]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_vmm_copy_into_queues_one_copy_per_piece(callers):
    from weightcache.native.shared.transport import cuda_vmm

    class Block:  # what copy_into needs of the block: its address and device
        device = "cuda:1"

        def data_ptr(self) -> int:
            return ALLOC_BASE

    class Stream:
        cuda_stream = 0xABC000

    arena = cuda_vmm.VmmArena(6 * GIB, 1, count=2)
    meta, fds = arena.export()
    client = cuda_vmm.VmmImported(meta, [os.dup(fd) for fd in fds], 1, readonly=False)
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        block = client.copy_into(Block, 6 * GIB)
    assert isinstance(block, Block)
    assert callers.of("cuMemcpyDtoDAsync_v2") == [
        (ALLOC_BASE, VA_BASE, GRANULE, 0xABC000),
        (ALLOC_BASE + GRANULE, VA_BASE + GRANULE, GIB, 0xABC000),
    ]
    client.close()
    arena.close()


def test_ipc_arena_and_handle_over_this_module(callers):
    from weightcache.native.shared.transport import cuda_ipc

    arena = cuda_ipc.IpcArena(6 * GIB, 0)
    assert callers.of("cuMemAlloc_v2") == [(6 * GIB,)]
    meta, fds = arena.export()
    assert fds == [] and meta["handle"] == IPC_RAW.hex()
    assert callers.of("cuIpcGetMemHandle") == [(ALLOC_BASE,)]
    handle = cuda_ipc._handle_from(bytes.fromhex(meta["handle"]))
    assert cuda_ipc._handle_bytes(handle) == IPC_RAW
    flags = lc.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    assert lc.cuIpcOpenMemHandle(handle, flags) == (SUCCESS, VA_BASE + 0x100)
    assert callers.of("cuIpcOpenMemHandle_v2") == [(IPC_RAW, 1)]
    cuda_ipc._close_ipc(VA_BASE + 0x100)
    assert callers.of("cuIpcCloseMemHandle") == [(VA_BASE + 0x100,)]
    arena.close()
    assert callers.of("cuMemFree_v2") == [(ALLOC_BASE,)]


# --- the choice of binding (cudadriver) ---------------------------------------------------


@pytest.fixture
def choose(monkeypatch) -> Any:
    """Set WEIGHTCACHE_CUDA_DRIVER (None: unset) and choose anew; forgotten afterwards."""
    from weightcache.native.shared import cudadriver

    def pick(value: str | None) -> Any:
        if value is None:
            monkeypatch.delenv(cudadriver.DRIVER_ENV, raising=False)
        else:
            monkeypatch.setenv(cudadriver.DRIVER_ENV, value)
        cudadriver.forget()
        return cudadriver

    yield pick
    cudadriver.forget()


@pytest.mark.bindings
def test_the_default_is_cuda_pythons_bindings(choose):
    real = _bindings()
    for value in (None, "", "bindings", " Bindings "):
        assert choose(value).driver() is real


@pytest.mark.bindings
def test_a_bad_choice_is_the_default_with_a_warning(choose, caplog):
    real = _bindings()
    with caplog.at_level("WARNING", logger="weightcache.native.shared.cudadriver"):
        assert choose("cffi").driver() is real
    assert "WEIGHTCACHE_CUDA_DRIVER='cffi' is none of bindings, ctypes" in caplog.text


@pytest.mark.bindings
def test_ctypes_without_libcuda_falls_back_to_the_bindings(choose, monkeypatch):
    real = _bindings()
    monkeypatch.setattr(lc, "_driver", None)
    monkeypatch.setattr(lc, "LIBRARY", "libcuda-not-here.so.1")
    assert choose("ctypes").driver() is real


@pytest.mark.bindings
def test_ctypes_chosen_and_loadable_is_this_module_and_staging_keeps_the_bindings(
        choose, fake):
    from weightcache.native.shared.transport import _cuda

    real = _bindings()
    choose("ctypes")
    assert _cuda.driver() is lc
    assert _cuda.bindings() is real  # the daemon's staging calls what lc does not bind
    assert _cuda.bindings_importable() and _cuda.full_bindings_importable()


def test_no_binding_at_all_makes_the_cuda_transports_unavailable():
    """Neither cuda-python nor libcuda: the transports say so (and a CPU install still
    imports them: tests/gpu/test_seam_cpu.py)."""
    code = textwrap.dedent(
        """
        import os
        os.environ["WEIGHTCACHE_CUDA_DRIVER"] = "ctypes"
        from weightcache.native.shared import _libcuda
        _libcuda.LIBRARY = "libcuda-not-here.so.1"
        from weightcache.native.shared.transport import _cuda, base
        from weightcache.native.shared import gpu
        assert not _cuda.bindings_importable() and not _cuda.full_bindings_importable()
        try:
            _cuda.driver()
        except base.TransportUnavailableError as exc:
            print("unavailable:", exc)
        assert gpu.visible_device_uuids() is None
        """
    )
    out = run_without_cuda_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("unavailable: CUDA transports need the driver bindings:"
                                  " pip install 'weightcache[cuda]'")
