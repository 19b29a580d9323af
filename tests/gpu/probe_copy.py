"""Where copy mode's driver time goes on a CUDA machine, before changing it (prints JSON).

Copy mode maps the daemon's arena (a `cuMemCreate` allocation exported as a file descriptor),
copies it into the engine's own block and unmaps it. On the H200 the copy itself ran at about
2 TB/s and the map and unmap around it took 1.4 ms of a 12.4 ms attach. This measures, on an
arena of PROBE_GB GiB exported by a second process, as copy mode sees it:
- each driver call of the map (import, reserve, map, grant access) and of the unmap;
- the same map with access granted (or the range mapped and granted) a piece at a time, each
  piece's copy queued as soon as it is readable, so the copy runs beside the rest of the map;
- a device-to-device copy between two blocks of this process (the copy's own limit), and a
  fresh allocation of the destination;
- an arena made of PROBE_PIECES allocations (one fd each), mapped into one reserved range a
  piece at a time with each piece's copy queued as soon as it is readable: the one way the
  driver lets the map overlap the copy;
- the whole map and copy while another thread allocates a fresh block as large (copy mode's
  destination, made by `torch.empty` on a thread while the map goes on): whether the two
  driver paths wait on each other;
- `dest_*` (PROBE_DEST=1): an engine's first load, into fresh memory, with the arena in
  PROBE_DEST_PIECES allocations: the destination made by `torch.empty` on a thread from the
  start (as the attach does), against one made of as many `cuMemCreate` allocations created and
  mapped a piece at a time beside the copies (inline, or on a thread ahead of them), so that the
  destination's allocation no longer sits in front of the first copy.

Run: `python3 tests/gpu/probe_copy.py` on the device (tests/gpu/run_device.sh probe_copy).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from weightcache.native.shared.transport import _cuda, cuda_vmm

GIB = 1 << 30
REPEATS = int(os.environ.get("PROBE_REPEATS", "7"))

_EXPORTER = r"""
import os, socket, sys, torch
from weightcache.native.shared.transport import cuda_vmm
sock = socket.socket(fileno=int(sys.argv[1]))
arena = cuda_vmm.VmmArena(int(sys.argv[2]), 0, count=1)  # one allocation: the probe maps one fd
arena.tensor().fill_(7)
torch.cuda.synchronize()
meta, fds = arena.export()
socket.send_fds(sock, [str(meta["size"]).encode()], fds)
sock.recv(1)  # until the parent closes
"""


_PIECES_EXPORTER = r"""
import json, os, socket, sys, torch
from weightcache.native.shared.transport import cuda_vmm
sock = socket.socket(fileno=int(sys.argv[1]))
total, n = int(sys.argv[2]), int(sys.argv[3])
gran = cuda_vmm.granularity(0)
each = (total // n + gran - 1) // gran * gran
arenas = [cuda_vmm.VmmArena(min(each, total - i * each), 0, count=1)
          for i in range(n) if i * each < total]
fds, sizes = [], []
for a in arenas:
    a.tensor().fill_(7)
    meta, f = a.export()
    fds += f
    sizes.append(meta["size"])
torch.cuda.synchronize()
socket.send_fds(sock, [json.dumps(sizes).encode()], fds)
sock.recv(1)  # until the parent closes
"""


def _access(cu: Any, ptr: int, size: int, readonly: bool = False) -> None:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    flags = cu.CUmemAccess_flags
    desc.flags = (flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly
                  else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    _cuda.check(cu.cuMemSetAccess(ptr, size, [desc], 1), "cuMemSetAccess")


def _copy(cu: Any, dst: int, src: int, at: int, n: int, stream: int) -> None:
    """Queue the copy of `n` bytes at offset `at` (none if `n` is 0)."""
    if n:
        _cuda.check(cu.cuMemcpyDtoDAsync(dst + at, src + at, n, stream), "cuMemcpyDtoDAsync")


def _import(cu: Any, fd: int) -> Any:
    """An allocation handle from a copy of the exporter's fd."""
    mine = os.dup(fd)
    try:
        return _cuda.check(cu.cuMemImportFromShareableHandle(
            mine, cuda_vmm._handle_type()), "import")
    finally:
        os.close(mine)


def _unmap(cu: Any, stream: int, mapped: list[tuple[int, int]], ptr: int, size: int,
           mark: Any) -> None:
    cu.cuStreamSynchronize(stream)
    for at, n in mapped:
        _cuda.check(cu.cuMemUnmap(at, n), "unmap")
    mark("unmap")
    _cuda.check(cu.cuMemAddressFree(ptr, size), "free")
    mark("address_free")


class _Clock:
    """Seconds per phase of one map, copy and unmap; `total` from the first call."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.t0 = self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def done(self) -> dict[str, float]:
        self.phases["total"] = time.perf_counter() - self.t0
        return self.phases


def _one(cu: Any, fd: int, size: int, dst: int, nbytes: int, stream: int, *,
         piece: int = 0, map_pieces: bool = False, readonly: bool = False) -> dict[str, float]:
    """One map, copy and unmap; seconds per phase (`total` from import to unmapped)."""
    clock = _Clock()
    mark = clock.mark

    handle = _import(cu, fd)
    mark("import")
    ptr = int(_cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0), "reserve"))
    mark("reserve")
    mapped: list[tuple[int, int]] = []
    try:
        if not map_pieces:
            _cuda.check(cu.cuMemMap(ptr, size, 0, handle, 0), "map")
            mapped.append((ptr, size))
            mark("map")
        step = piece or size
        for at in range(0, size, step):
            n = min(step, size - at)
            if map_pieces:
                _cuda.check(cu.cuMemMap(ptr + at, n, at, handle, 0), "map")
                mapped.append((ptr + at, n))
                mark("map")
            _access(cu, ptr + at, n, readonly)
            mark("access")
            _copy(cu, dst, ptr, at, min(n, max(0, nbytes - at)), stream)
            mark("queue")
        _cuda.check(cu.cuStreamSynchronize(stream), "sync")
        mark("copy_wait")
    finally:
        cu.cuMemRelease(handle)
        _unmap(cu, stream, mapped, ptr, size, mark)
    return clock.done()


def _pieces_one(cu: Any, fds: list[int], sizes: list[int], dst: int, nbytes: int,
                stream: int) -> dict[str, float]:
    """One map, copy and unmap of an arena of several allocations: each piece imported,
    mapped at its place in one reserved range, granted, and its copy queued, in turn."""
    clock = _Clock()
    mark = clock.mark

    size = sum(sizes)
    ptr = int(_cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0), "reserve"))
    mark("reserve")
    mapped: list[tuple[int, int]] = []
    try:
        at = 0
        for fd, n in zip(fds, sizes, strict=True):
            handle = _import(cu, fd)
            mark("import")
            try:
                _cuda.check(cu.cuMemMap(ptr + at, n, 0, handle, 0), "map")
            finally:
                cu.cuMemRelease(handle)
            mapped.append((ptr + at, n))
            mark("map")
            _access(cu, ptr + at, n)
            mark("access")
            _copy(cu, dst, ptr, at, min(n, max(0, nbytes - at)), stream)
            mark("queue")
            at += n
        _cuda.check(cu.cuStreamSynchronize(stream), "sync")
        mark("copy_wait")
    finally:
        _unmap(cu, stream, mapped, ptr, size, mark)
    return clock.done()


def _pieces(cu: Any, nbytes: int, dst: int, stream: int, count: int) -> dict[str, Any]:
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", _PIECES_EXPORTER, str(child.fileno()),
                             str(nbytes), str(count)], pass_fds=[child.fileno()])
    child.close()
    try:
        msg, fds, _, _ = socket.recv_fds(parent, 4096, 256)
        sizes = json.loads(msg)
        _pieces_one(cu, fds, sizes, dst, nbytes, stream)  # warm the path
        runs = [_pieces_one(cu, fds, sizes, dst, nbytes, stream) for _ in range(REPEATS)]
        out = _median(runs, nbytes)
        out["pieces"] = len(sizes)
        for fd in fds:
            os.close(fd)
        return out
    finally:
        parent.close()
        proc.wait(timeout=30)


def _dest_one(cu: Any, fds: list[int], sizes: list[int], nbytes: int, stream: int, how: str
              ) -> dict[str, float]:
    """One copy of the pieced arena into fresh memory made `how` (torch / vmm / vmm_thread);
    the destination is given back after the clock (an engine has no earlier copy to free)."""
    import threading

    from weightcache.native.shared.transport.cuda_vmm import _map_at, _prop

    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    clock = _Clock()
    mark = clock.mark
    size = sum(sizes)
    held: list[torch.Tensor] = []
    made: list[Any] = []  # destination handles
    dst_range = 0
    ready = [threading.Event() for _ in sizes]
    worker = None
    if how == "torch":
        worker = threading.Thread(target=lambda: (held.append(
            torch.empty(size, dtype=torch.uint8, device="cuda")), ready[0].set()))
        worker.start()
    else:
        dst_range = int(_cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0), "reserve"))

        def create(k: int) -> None:
            _cuda.make_current(0)
            h = _cuda.check(cu.cuMemCreate(sizes[k], _prop(0), 0), "cuMemCreate")
            made.append(h)
            _map_at(dst_range + sum(sizes[:k]), sizes[k], h, 0)
            ready[k].set()

        if how == "vmm_thread":
            worker = threading.Thread(target=lambda: [create(k) for k in range(len(sizes))])
            worker.start()
    mark("started")
    ptr = int(_cuda.check(cu.cuMemAddressReserve(size, 0, 0, 0), "reserve"))
    mapped: list[tuple[int, int]] = []
    try:
        at = 0
        for k, (fd, n) in enumerate(zip(fds, sizes, strict=True)):
            handle = _import(cu, fd)
            try:
                _cuda.check(cu.cuMemMap(ptr + at, n, 0, handle, 0), "map")
            finally:
                cu.cuMemRelease(handle)
            mapped.append((ptr + at, n))
            _access(cu, ptr + at, n)
            mark("src_map")
            if how == "vmm":
                create(k)
                mark("dst_create")
            if how == "torch":
                ready[0].wait()
                dst = held[0].data_ptr()
            else:
                ready[k].wait()
                dst = dst_range
            mark("dst_wait")
            _copy(cu, dst, ptr, at, min(n, max(0, nbytes - at)), stream)
            mark("queue")
            at += n
        _cuda.check(cu.cuStreamSynchronize(stream), "sync")
        mark("copy_wait")
        out = clock.done()
        check = (held[0] if held else
                 _cuda.DeviceMemory(dst_range, nbytes, 0, lambda: None).tensor())
        out["copied_right"] = float(bool((check[nbytes - (1 << 20):nbytes] == 7).all()))
        del check
        return out
    finally:
        if worker is not None:
            worker.join()
        _unmap(cu, stream, mapped, ptr, size, lambda _name: None)
        held.clear()
        at = 0
        for h, n in zip(made, sizes, strict=False):
            cu.cuMemUnmap(dst_range + at, n)
            cu.cuMemRelease(h)
            at += n
        if dst_range:
            cu.cuMemAddressFree(dst_range, size)


def _dest(cu: Any, nbytes: int, stream: int, count: int) -> dict[str, Any]:
    """`_dest_one` for each way, in turn, REPEATS times after a warm-up of each."""
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", _PIECES_EXPORTER, str(child.fileno()),
                             str(nbytes), str(count)], pass_fds=[child.fileno()])
    child.close()
    ways = ("torch", "vmm", "vmm_thread")
    try:
        msg, fds, _, _ = socket.recv_fds(parent, 4096, 256)
        sizes = json.loads(msg)
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        for w in ways:
            _dest_one(cu, fds, sizes, nbytes, stream, w)  # warm the path
        for _ in range(REPEATS):
            for w in ways:
                runs[w].append(_dest_one(cu, fds, sizes, nbytes, stream, w))
        out: dict[str, Any] = {"pieces": len(sizes)}
        for w in ways:
            out[w] = _median(runs[w], nbytes)
            out[w]["copied_right"] = all(r["copied_right"] == 1.0 for r in runs[w])
        for fd in fds:
            os.close(fd)
        return out
    finally:
        parent.close()
        proc.wait(timeout=30)


def _spin_while(work: Any) -> tuple[float, float]:
    """(main-thread loop iterations per ms while `work` runs on a thread, its seconds)."""
    import threading
    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        work()
        took.append(time.perf_counter() - t)
        done.set()

    th = threading.Thread(target=run)
    n, t0 = 0, time.perf_counter()
    th.start()
    while not done.is_set():
        n += 1
    spun = time.perf_counter() - t0
    th.join()
    return n / (spun * 1e3), took[0]


def _gil(cu: Any, size: int) -> dict[str, Any]:
    """Does a 16 GB allocation on a thread hold the GIL: torch's caching allocator against
    the driver's `cuMemAlloc` (the main thread's loop rate while each runs)."""
    out: dict[str, Any] = {}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.005:
        n += 1
    out["idle_iters_per_ms"] = round(n / 5, 1)

    def torch_alloc() -> None:
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del block

    def driver_alloc() -> None:
        _cuda.make_current(0)
        ptr = _cuda.check(cu.cuMemAlloc(size), "cuMemAlloc")
        _cuda.check(cu.cuMemFree(ptr), "cuMemFree")

    for name, work in (("torch_empty", torch_alloc), ("cuMemAlloc_free", driver_alloc)):
        rates, secs = [], []
        for _ in range(5):
            torch.cuda.empty_cache()
            rate, took = _spin_while(work)
            rates.append(rate)
            secs.append(took)
        out[name] = {"iters_per_ms": round(statistics.median(rates), 1),
                     "ms": round(statistics.median(secs) * 1e3, 3)}
    return out


def _median(runs: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    keys = runs[0].keys()
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs) * 1e3, 3) for k in keys}
    out["tb_per_s"] = round(nbytes / (out["total"] / 1e3) / 1e12, 3)
    out["totals_ms"] = [round(r["total"] * 1e3, 3) for r in runs]
    return out


def main() -> None:
    nbytes = int(float(os.environ.get("PROBE_GB", "15")) * GIB)
    cu = _cuda.driver()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    _cuda.make_current(0)
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", _EXPORTER, str(child.fileno()), str(nbytes)],
                            pass_fds=[child.fileno()])
    child.close()
    msg, fds, _, _ = socket.recv_fds(parent, 64, 1)
    size, fd = int(msg), fds[0]
    stream = torch.cuda.current_stream().cuda_stream
    result: dict[str, Any] = {"nbytes": nbytes, "size": size, "repeats": REPEATS,
                              "device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    t0 = time.perf_counter()
    dst_t = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    result["allocate_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    src_t = torch.empty(size, dtype=torch.uint8, device="cuda")
    d2d = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst_t[:nbytes].copy_(src_t[:nbytes])
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    result["d2d_local"] = {"ms": round(statistics.median(d2d) * 1e3, 3),
                           "tb_per_s": round(nbytes / statistics.median(d2d) / 1e12, 3)}
    del src_t
    torch.cuda.empty_cache()
    dst = dst_t.data_ptr()
    result["gil"] = _gil(cu, size)
    print("gil", json.dumps(result["gil"]), flush=True)

    print("d2d_local", json.dumps(result["d2d_local"]), "allocate_ms", result["allocate_ms"],
          flush=True)
    cases: dict[str, dict[str, Any]] = {
        "whole": {},
        "whole_readonly": {"readonly": True},
        # A piece at a time: access granted to part of one mapping, and part of the allocation
        # mapped at an offset (runs 29-30 on the H200's driver 580: CUDA_ERROR_INVALID_VALUE
        # and CUDA_ERROR_NOT_SUPPORTED; kept to see whether a driver ever allows it).
        "access_1024m": {"piece": 1 << 30},
        "map_1024m": {"piece": 1 << 30, "map_pieces": True},
    }
    for name, kw in cases.items():
        try:
            _one(cu, fd, size, dst, nbytes, stream, **kw)  # warm the path
        except _cuda.CudaCallError as exc:
            result[name] = {"error": str(exc)}
            print(name, json.dumps(result[name]), flush=True)
            continue
        runs = [_one(cu, fd, size, dst, nbytes, stream, **kw) for _ in range(REPEATS)]
        result[name] = _median(runs, nbytes)
        print(name, json.dumps(result[name]), flush=True)
    import threading

    def alloc_beside() -> dict[str, float]:
        torch.cuda.empty_cache()
        held: list[torch.Tensor] = []
        th = threading.Thread(target=lambda: held.append(
            torch.empty(size, dtype=torch.uint8, device="cuda")))
        th.start()
        phases = _one(cu, fd, size, dst, nbytes, stream)
        t0 = time.perf_counter()
        th.join()
        phases["alloc_wait"] = time.perf_counter() - t0
        held.clear()
        return phases

    try:
        alloc_beside()
        result["whole_alloc_beside"] = _median([alloc_beside() for _ in range(REPEATS)], nbytes)
    except (_cuda.CudaCallError, torch.OutOfMemoryError) as exc:
        result["whole_alloc_beside"] = {"error": str(exc)}
    print("whole_alloc_beside", json.dumps(result["whole_alloc_beside"]), flush=True)
    for count in (int(c) for c in os.environ.get("PROBE_PIECES", "2,4,8,16").split(",") if c):
        dst_t.zero_()
        torch.cuda.synchronize()
        name = f"allocations_{count}"
        try:
            result[name] = _pieces(cu, nbytes, dst, stream, count)
            last = dst_t[nbytes - (1 << 20):nbytes].cpu()
            result[name]["copied_right"] = bool((last == 7).all())
        except _cuda.CudaCallError as exc:
            result[name] = {"error": str(exc)}
        print(name, json.dumps(result[name]), flush=True)
    check = dst_t[:1 << 20].cpu()
    result["copied_right"] = bool((check == 7).all())
    if os.environ.get("PROBE_DEST", "1") == "1":
        del dst_t, check
        torch.cuda.empty_cache()
        count = int(os.environ.get("PROBE_DEST_PIECES", "4"))
        try:
            result["dest"] = _dest(cu, nbytes, stream, count)
        except (_cuda.CudaCallError, torch.OutOfMemoryError) as exc:
            result["dest"] = {"error": str(exc)}
        print("dest", json.dumps(result["dest"]), flush=True)
    print(json.dumps(result, indent=1))
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    parent.close()
    proc.wait(timeout=30)


if __name__ == "__main__":
    main()
