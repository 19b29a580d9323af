"""Whether setting up the fill's pinned buffers stalls the disk reads beside it (prints JSON).

When a rank's fill begins, each of its 32 readers allocates two 16 MiB pinned buffers (torch's
host allocator: one 32 MiB `cudaHostAlloc` each), 1 GiB in all, while the rank's early reads go
on beside the fill with O_DIRECT into fresh anonymous memory. On the H200 a pinned allocation
ran at about 1.07 GB/s (run31's `pin_alloc` bound), the last reader was ready 0.39-0.56 s after
every cold fill began, and in one READY (run31, `sharded`, every cache dropped) the disk stood
idle for 0.5 s right then. Pinning takes the process's memory-map lock, which the early reads'
page faults need too: this measures whether that is what stopped the disk, and what would not.

On the device's disk, 32 readers like the early reads (16 MiB O_DIRECT reads, one anonymous
mapping with MADV_HUGEPAGE, file order) run for WARM_S; then one way of setting up the fill's
buffers runs beside them, on 32 threads started together:
- `none`: nothing (the readers' own rate);
- `torch2x16`: each thread one `torch.empty(32 MiB, pin_memory=True)` (the fill today);
- `torch1x16`: each thread one 16 MiB block (one buffer a reader: half the pinning);
- `register`: each thread 32 MiB of its own anonymous memory, touched, then `cudaHostRegister`.
Each case in a fresh process (torch's host allocator keeps what it pinned), the file dropped
from the page cache before it. For each: when the last thread was ready, and the readers' GB/s
in the second before the set-up, during it and in the second after, with the longest time no
read completed.

Run: `tests/gpu/run_device.sh probe_pin` (PROBE_GB of file, default 12; PROBE_CASES narrows).
On the H200 (run34, docs/performance.md): the set-up as today took 0.42 s, the reads beside it
ran at 0.9x meanwhile and never paused more than 0.13 s; it is not what stalls the disk.
`python3 tests/gpu/probe_pin.py --dry` runs the `none` case on a small file, on any machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
READ = 16 * MiB
READERS = 32
SETUP_THREADS = 32
WARM_S = 1.0
AFTER_S = 1.0
CASES = ("none", "torch2x16", "torch1x16", "register")


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: Path, size: int) -> None:
    block = os.urandom(64 * MiB)
    with open(path, "wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())


class Readers:
    """READERS threads reading the file front to back in READ pieces into one mapping."""

    def __init__(self, path: Path, direct: bool) -> None:
        self.size = path.stat().st_size
        self.map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.map.madvise(mmap.MADV_HUGEPAGE)
        self.path, self.direct = path, direct
        self.done: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(READERS)]

    def start(self) -> Readers:
        for t in self.threads:
            t.start()
        return self

    def _claim(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self._next >= self.size:
                return None
            at, self._next = self._next, self._next + READ
            return at

    def _run(self) -> None:
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.path, flags)
        view = memoryview(self.map)
        try:
            while (at := self._claim()) is not None:
                n = os.preadv(fd, [view[at : at + READ]], at)
                with self._lock:
                    self.done.append((time.perf_counter(), n))
        finally:
            view.release()
            os.close(fd)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join()

    def rate(self, start: float, end: float) -> float:
        """GB/s of the reads that completed in [start, end)."""
        got = sum(n for t, n in self.done if start <= t < end)
        return round(got / max(end - start, 1e-9) / 1e9, 3)

    def longest_gap(self, start: float, end: float) -> float:
        times = sorted(t for t, _ in self.done if start <= t < end)
        edges = [start, *times, end]
        return round(max(b - a for a, b in itertools.pairwise(edges)), 4)


def _setup(case: str) -> list[float]:
    """Run the case's set-up on SETUP_THREADS threads started together; when each was ready."""
    kept: list[Any] = []
    ready: list[float] = []
    errors: list[str] = []
    go = threading.Event()
    lock = threading.Lock()

    def one() -> None:
        go.wait()
        try:
            if case in ("torch2x16", "torch1x16"):
                import torch

                nbytes = 2 * READ if case == "torch2x16" else READ
                block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            elif case == "register":
                import numpy as np
                import torch

                block = mmap.mmap(-1, 2 * READ, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                np.frombuffer(block, dtype=np.uint8)[:] = 0  # faulted in, as a buffer in use is
                ptr = ctypes.addressof(ctypes.c_char.from_buffer(block))
                err = torch.cuda.cudart().cudaHostRegister(ptr, 2 * READ, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister: {err}")
            else:
                block = None
            with lock:
                kept.append(block)
                ready.append(time.perf_counter())
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one) for _ in range(SETUP_THREADS)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    _setup.kept = kept  # type: ignore[attr-defined]  # alive until the process ends
    return ready


def case_main(case: str, path: Path, direct: bool) -> dict[str, Any]:
    if case != "none":
        import torch

        torch.cuda.set_device(0)
        torch.empty(0, device="cuda")  # the context exists before the fill, as in a rank
    readers = Readers(path, direct).start()
    time.sleep(WARM_S)
    t0 = time.perf_counter()
    error = None
    try:
        ready = _setup(case)
    except RuntimeError as exc:
        error, ready = str(exc), []
    t1 = max(ready, default=time.perf_counter())
    time.sleep(AFTER_S)
    readers.stop()
    out: dict[str, Any] = {
        "case": case,
        "setup_s": round(t1 - t0, 4),
        "first_ready_s": round(min(ready) - t0, 4) if ready else None,
        "median_ready_s": round(sorted(ready)[len(ready) // 2] - t0, 4) if ready else None,
        "gb_per_s_before": readers.rate(t0 - WARM_S / 2, t0),
        "gb_per_s_during": readers.rate(t0, t1) if t1 > t0 + 0.01 else None,
        "gb_per_s_after": readers.rate(t1, t1 + AFTER_S),
        "longest_gap_during_s": readers.longest_gap(t0, t1) if t1 > t0 + 0.01 else None,
        "read_gb": round(sum(n for _, n in readers.done) / 1e9, 2),
        "file_gb": round(readers.size / 1e9, 2),
    }
    if error:
        out["error"] = error
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--case":
        print(json.dumps(case_main(argv[1], Path(argv[2]), argv[3] == "1")))
        return 0
    dry = bool(argv) and argv[0] == "--dry"
    size = (1 if dry else int(os.environ.get("PROBE_GB", "12"))) * GiB
    cases = ("none",) if dry else tuple(
        c for c in os.environ.get("PROBE_CASES", ",".join(CASES)).split(",") if c)
    work = Path(os.environ.get("PROBE_DIR") or tempfile.mkdtemp(prefix="wc-probe-pin-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / "data"
    if not path.exists() or path.stat().st_size != size:
        _write(path, size)
    direct = hasattr(os, "O_DIRECT")
    results = []
    for case in cases:
        _drop(path)
        proc = subprocess.run([sys.executable, __file__, "--case", case, str(path),
                               "1" if direct else "0"], capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "case": case, "error": (proc.stderr or "no output")[-2000:]}
        print(json.dumps(result), flush=True)
        results.append(result)
    report = {"read_mib": READ // MiB, "readers": READERS, "setup_threads": SETUP_THREADS,
              "warm_s": WARM_S, "cases": results}
    if out := os.environ.get("PROBE_OUT"):
        Path(out).write_text(json.dumps(report, indent=1))
    if not os.environ.get("PROBE_DIR"):
        path.unlink()
        work.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
