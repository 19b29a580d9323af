# ruff: noqa: B023, SIM105 (each closure runs and is joined within its own loop pass)
"""Where the load's time goes on the GPU machine, part by part (issue 22's measurements).

Two questions, answered on the machine itself because the answers depend on its cores and its
disk:

- `hash`: does the content digest scale with threads, per chunk size? The fill hashes every
  chunk from the buffer it landed in, in its 32 reader threads; each chunk costs a few
  interpreter steps under the GIL besides the hash itself (which releases it).
- `contend`: how much do reads in the background slow a cold `import torch` (what a rank and
  an engine pay at start), per number of readers, read size and I/O priority, and what rate do
  the background reads get meanwhile.

    python3 tests/gpu/probe_io.py WORKDIR OUT.json [hash] [contend]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# torch-free: the probe times cold torch imports in child processes
from weightcache.bench.gpu import timed_threads

MiB = 1 << 20
GB = 1e9


def hash_part(workdir: Path) -> dict:
    from blake3 import blake3

    size = 1024 * MiB
    data = memoryview(os.urandom(4 * MiB) * (size // (4 * MiB)))
    out: dict = {"in_memory": [], "warm_fill": []}

    def add(view: memoryview, step: int, sink: bytearray) -> None:
        for k, at in enumerate(range(0, len(view), step)):
            sink[k * 16 : (k + 1) * 16] = blake3(view[at : at + step]).digest(16)

    for step in (256 << 10, 1 << 20, 4 << 20):
        pieces = [data[i : i + 16 * MiB] for i in range(0, size, 16 * MiB)]
        for threads in (1, 4, 8, 16, 32):
            best = 0.0
            for _ in range(2):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda v: add(v, step, bytearray(16 * 64)), pieces))
                best = max(best, size / (time.perf_counter() - t0) / GB)
            out["in_memory"].append({"chunk_kib": step >> 10, "threads": threads,
                                     "gb_per_s": round(best, 2)})
            print("hash", step >> 10, threads, round(best, 2), flush=True)

    # A warm fill without the device: 32 threads pread a page-cached 4 GiB file in 16 MiB
    # jobs, each through `hot` pieces, hashing `step` chunks (step 0: no hash).
    path = workdir / "warm.bin"
    with open(path, "wb") as fh:
        for _ in range(4096 // 64):
            fh.write(os.urandom(64 * MiB))
    fsize = path.stat().st_size
    with open(path, "rb") as fh:  # into the page cache
        while fh.read(64 * MiB):
            pass
    for step, hot, threads in ((0, 1 << 20, 32), (256 << 10, 1 << 20, 32), (256 << 10, 1 << 20, 16),
                               (256 << 10, 1 << 20, 8), (1 << 20, 4 << 20, 32),
                               (1 << 20, 4 << 20, 16), (4 << 20, 4 << 20, 32),
                               (4 << 20, 16 << 20, 32), (4 << 20, 4 << 20, 16)):
        jobs = list(range(0, fsize, 16 * MiB))
        lock = threading.Lock()

        def worker() -> None:
            fd = os.open(path, os.O_RDONLY)
            buf = bytearray(16 * MiB)
            view = memoryview(buf)
            sink = bytearray(16 * 64)
            try:
                while True:
                    with lock:
                        if not jobs:
                            return
                        start = jobs.pop()
                    got = 0
                    while got < 16 * MiB:
                        n = os.preadv(fd, [view[got : got + hot]], start + got)
                        if step:
                            add(view[got : got + n], step, sink)
                        got += n
            finally:
                os.close(fd)

        rate = fsize / timed_threads(worker, threads) / GB
        out["warm_fill"].append({"chunk_kib": step >> 10, "hot_kib": hot >> 10,
                                 "threads": threads, "gb_per_s": round(rate, 2)})
        print("warm", step >> 10, hot >> 10, threads, round(rate, 2), flush=True)
    path.unlink()
    return out


def _drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def _ioprio_idle() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # ioprio_set(IOPRIO_WHO_PROCESS=1, 0 = this thread, IOPRIO_CLASS_IDLE << 13)
    libc.syscall(251, 1, 0, 3 << 13)


def contend_part(workdir: Path) -> dict:
    path = workdir / "contend.bin"
    size = 12 * 1024 * MiB
    block = os.urandom(64 * MiB)
    with open(path, "wb") as fh:
        for _ in range(size // (64 * MiB)):
            fh.write(block)
        os.fsync(fh.fileno())
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    info: dict = {"file_dev": dev, "diskstats": Path("/proc/diskstats").read_text()[:4000]}
    for name in os.listdir("/sys/block"):
        q = Path("/sys/block", name, "queue")
        try:
            info[name] = {k: (q / k).read_text().strip() for k in
                          ("scheduler", "nr_requests", "max_sectors_kb", "read_ahead_kb",
                           "rotational")}
        except OSError:
            pass
    try:
        info["sys_dev_block"] = os.path.realpath(f"/sys/dev/block/{dev}")
    except OSError:
        pass
    print(json.dumps(info)[:3000], flush=True)
    rows = []
    cmd = [sys.executable, "-c", "import time; t=time.perf_counter(); import torch; "
           "torch.zeros(1, device='cuda'); print(time.perf_counter()-t)"]
    import torch

    info["torch_dev"] = f"{os.major(os.stat(torch.__file__).st_dev)}:" \
                        f"{os.minor(os.stat(torch.__file__).st_dev)}"
    configs = [(0, 0, False, True)]
    for threads, req in ((32, 16), (8, 16), (4, 16), (4, 4), (2, 4), (2, 1), (1, 4), (1, 1)):
        configs += [(threads, req, True, False), (threads, req, True, True)]
    configs += [(2, 4, False, True), (0, 0, False, True)]
    for threads, req, idle, with_import in configs:
        _drop()
        stop = threading.Event()
        done = [0]
        lock = threading.Lock()
        next_off = [0]

        def reader() -> None:
            if idle:
                _ioprio_idle()
            import mmap

            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, req * MiB)
            view = memoryview(buf)
            try:
                while not stop.is_set():
                    with lock:
                        off = next_off[0]
                        next_off[0] = (off + req * MiB) % size
                    n = os.preadv(fd, [view], off)
                    with lock:
                        done[0] += n
            finally:
                os.close(fd)

        ts = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        inner: float | str | None = None
        if with_import:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                inner = float(res.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                inner = "over 30 s"
            except (ValueError, IndexError):
                inner = None
        else:
            time.sleep(3)
        wall = time.perf_counter() - t0
        stop.set()
        for t in ts:
            t.join()
        row = {"threads": threads, "read_mib": req, "idle": idle,
               "import_torch_cuda_s": inner, "wall_s": round(wall, 3),
               "background_gb_per_s": round(done[0] / wall / GB, 3)}
        rows.append(row)
        print("contend", row, flush=True)
    path.unlink()
    return {"info": info, "rows": rows}


def main() -> None:
    workdir, out = Path(sys.argv[1]), Path(sys.argv[2])
    parts = sys.argv[3:] or ["hash", "contend"]
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if "hash" in parts:
        result["hash"] = hash_part(workdir)
    if "contend" in parts:
        result["contend"] = contend_part(workdir)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
