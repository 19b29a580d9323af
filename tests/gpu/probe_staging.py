"""Where update staging's time goes on a CUDA machine, before changing it (prints JSON).

Staging an update needs the arena's size in host memory that the copy to the device can read
at the link's speed. This measures, on one file of PROBE_GB GiB in the page cache:
- populating fresh anonymous memory, then the same size again once it was freed (is the cost
  the memory's first touch since boot, or every allocation's?);
- reading the file into that memory with and without the chunk digest (the staging read);
- mapping the file itself read-only and registering the mapping with the driver
  (`cudaHostRegisterReadOnly`): staging with no host copy at all, if the driver allows it;
- host-to-device from that mapping, registered and not, and device-to-host (the rollback copy).

Run: `python3 tests/gpu/probe_staging.py` on the device (tests/gpu/run_device.sh probe_staging).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from weightcache.native.shared import content, hostmem, libc

GIB = 1 << 30
PIECE = 64 << 20
MADV_POPULATE_READ = 22
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
_madvise = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


def _write(path: str, size: int) -> None:
    block = np.random.default_rng(7).integers(0, 256, 256 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _pread_into(fd: int, dst: np.ndarray, threads: int, digest: bool) -> None:
    def work(at: int) -> None:
        view = memoryview(dst[at: at + PIECE])
        got = os.preadv(fd, [view], at)
        if digest:
            for c in range(0, got, content.CHUNK_BYTES):
                content.chunk_digest(view[c: c + content.CHUNK_BYTES])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(0, dst.size, PIECE)))


def _hash_mapping(arr: np.ndarray, threads: int) -> None:
    def work(at: int) -> None:
        view = memoryview(arr[at: at + PIECE])
        for c in range(0, len(view), content.CHUNK_BYTES):
            content.chunk_digest(view[c: c + content.CHUNK_BYTES])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(0, arr.size, PIECE)))


def _populate_read(addr: int, size: int, threads: int) -> bool:
    def work(at: int) -> bool:
        return _madvise(addr + at, min(GIB, size - at), MADV_POPULATE_READ) == 0

    with ThreadPoolExecutor(threads) as pool:
        return all(pool.map(work, range(0, size, GIB)))


def _h2d(src: torch.Tensor, dst: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() / (time.perf_counter() - t0) / 1e9


def main() -> int:
    size = int(os.environ.get("PROBE_GB", "8")) * GIB
    threads = int(os.environ.get("PROBE_THREADS", "16"))
    work = os.environ.get("PROBE_DIR", "/var/tmp/wc-probe")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "file.bin")
    out: dict[str, object] = {"bytes": size, "threads": threads, "cores": os.cpu_count(),
                              "torch": torch.__version__, "cuda": torch.version.cuda}
    rt = torch.cuda.cudart()
    torch.cuda.init()
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    _, out["write_file_s"] = _timed(_write, path, size)

    # Fresh anonymous memory, then the same size again after it was freed.
    buf, out["populate_fresh_s"] = _timed(hostmem.populated, size)
    buf.close()
    buf, out["populate_again_s"] = _timed(hostmem.populated, size)
    arr = np.frombuffer(buf, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    _, t = _timed(_pread_into, fd, arr, threads, False)
    out["pread_reused_gb_s"] = round(size / t / 1e9, 2)
    _, t = _timed(_pread_into, fd, arr, threads, True)
    out["pread_digest_reused_gb_s"] = round(size / t / 1e9, 2)
    ptr = arr.ctypes.data
    err, out["register_touched_s"] = _timed(rt.cudaHostRegister, ptr, size, 0)
    out["register_touched_err"] = int(getattr(err, "value", err))
    host = torch.from_numpy(arr)
    out["h2d_pinned_gb_s"] = round(_h2d(host, dev), 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    out["d2h_pinned_gb_s"] = round(size / (time.perf_counter() - t0) / 1e9, 2)
    _, out["unregister_s"] = _timed(rt.cudaHostUnregister, ptr)
    del host, arr
    buf.close()

    # The file's own pages, mapped read-only: no host copy.
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    farr = np.frombuffer(mapping, dtype=np.uint8)
    fptr = farr.ctypes.data
    ok, out["map_populate_read_s"] = _timed(_populate_read, fptr, size, 8)
    out["map_populate_read_ok"] = ok
    _, t = _timed(_hash_mapping, farr, threads)
    out["digest_mapping_gb_s"] = round(size / t / 1e9, 2)
    src = torch.from_numpy(farr) if farr.flags.writeable else torch.frombuffer(
        mapping, dtype=torch.uint8)
    out["h2d_pageable_mapping_gb_s"] = round(_h2d(src, dev), 2)
    for flags in (REGISTER_READ_ONLY, 0):
        err, secs = _timed(rt.cudaHostRegister, fptr, size, flags)
        code = int(getattr(err, "value", err))
        out[f"register_mapping_flags{flags}"] = {"err": code, "seconds": round(secs, 4)}
        if code == 0:
            out[f"register_mapping_flags{flags}"]["h2d_gb_s"] = round(_h2d(src, dev), 2)
            _, usecs = _timed(rt.cudaHostUnregister, fptr)
            out[f"register_mapping_flags{flags}"]["unregister_s"] = round(usecs, 4)
        else:  # clear the (non-sticky) error before torch's next check sees it
            getattr(rt, "cudaGetLastError", lambda: None)()
    del src, farr
    os.close(fd)
    os.unlink(path)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
