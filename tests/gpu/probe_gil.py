"""How long `import torch` holds the GIL, and what that does to O_DIRECT reads in Python
threads beside it (a rank's early reads): per configuration, a fresh process reads a cold file
with N threads of S MiB each while its main thread imports torch (or sleeps, the control), and
reports the disk's rate in 50 ms bins and the longest span with no read landing.

    python3 tests/gpu/probe_gil.py WORKDIR OUT.json
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

GB = 1e9
MiB = 1 << 20


def child(path: str, threads: int, size_mib: int, iov: int, mode: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total = os.fstat(fd).st_size
    size = size_mib * MiB
    landed: list[tuple[float, int]] = []
    gaps: list[tuple[float, float]] = []
    nxt = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def work() -> None:
        bufs = [mmap.mmap(-1, size) for _ in range(iov)]
        while not stop.is_set():
            with lock:
                off = nxt[0]
                if off >= total:
                    return
                nxt[0] += size * iov
            n = os.preadv(fd, [memoryview(b) for b in bufs], off)
            landed.append((time.monotonic(), n))
            if n == 0:
                return

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append((now - last, now))
            last = now

    t0 = time.monotonic()
    ts = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    tk = threading.Thread(target=tick, daemon=True)
    tk.start()
    time.sleep(0.3)  # the reads at their rate first
    i0 = time.monotonic()
    if mode == "import":
        import torch

        torch.cuda.init() if torch.cuda.is_available() else None
    else:
        time.sleep(2.5)
    i1 = time.monotonic()
    time.sleep(0.3)
    stop.set()
    landed.sort()
    bins: dict[int, int] = {}
    for at, n in landed:
        bins[int((at - t0) / 0.05)] = bins.get(int((at - t0) / 0.05), 0) + n
    span = int((time.monotonic() - t0) / 0.05)
    rates = [round(bins.get(i, 0) / 0.05 / GB, 2) for i in range(span)]
    no_land = 0.0
    prev = i0
    for at, _ in landed:
        if i0 <= at <= i1:
            no_land = max(no_land, at - prev)
            prev = at
    inside = [(g, w) for g, w in gaps if i0 <= w <= i1 + 0.01]  # the ticker's gaps
    during = sum(n for at, n in landed if i0 <= at <= i1)
    before = sum(n for at, n in landed if t0 + 0.1 <= at <= i0)
    print(json.dumps({
        "threads": threads, "read_mib": size_mib * iov, "mode": mode,
        "import_s": round(i1 - i0, 3),
        "gb_per_s_before": round(before / (i0 - t0 - 0.1) / GB, 2),
        "gb_per_s_during": round(during / (i1 - i0) / GB, 2),
        "longest_no_read_landed_s": round(no_land, 3),
        "longest_gil_gap_s": round(max((g for g, w in inside), default=0), 3),
        "gil_gaps_over_50ms_s": round(sum(g for g, w in inside if g > 0.05), 3),
        "bins_50ms": rates}))


def main() -> None:
    work, out = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "blob")
    if not os.path.exists(path):
        block = os.urandom(64 * MiB)
        with open(path, "wb") as fh:
            for _ in range(160):  # 10 GiB
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
    results = []
    configs = [(32, 16, 1, "sleep"), (32, 16, 1, "import"), (32, 16, 4, "import"),
               (128, 16, 1, "import"), (32, 16, 1, "import"), (32, 16, 4, "import"),
               (32, 16, 4, "sleep")]
    for threads, size, iov, mode in configs:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        with open("/proc/sys/vm/drop_caches", "w") as fh:  # root on the device machine
            fh.write("1")
        # torch's own files warm, as on a rank's restart: read them before the run
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        r = subprocess.run([sys.executable, __file__, "child", path, str(threads), str(size),
                            str(iov), mode], capture_output=True, text=True, timeout=120)
        line = (r.stdout.strip().splitlines() or ["{}"])[-1]
        print(line if r.returncode == 0 else r.stderr[-2000:], flush=True)
        if r.returncode == 0:
            results.append(json.loads(line))
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
