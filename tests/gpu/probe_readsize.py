"""Whether the read pattern alone sets the disk's rate on the GPU machine (prints JSON).

The fill reads a cold checkpoint with 32 readers of 16 MiB (O_DIRECT, one read in flight per
reader), the bench's device read with 32 readers of 64 MiB, popping its jobs from the end. A
torch-free process reading the fill's way reached 1.69-1.83 GB/s where the device read ran
1.87-2.17 (run95). This reads one file of PROBE_GB GiB with every cache dropped before each
read, pattern after pattern in turn for PROBE_ROUNDS rounds: readers x MiB, front to back or
back to front (the bench's own device read, `raw_read_rate`), so the pattern's own cost is seen
apart from the rank's.

Run: `python3 tests/gpu/probe_readsize.py` as root on the device
(tests/gpu/run_device.sh probe_readsize). Needs no torch and no GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from probe_pin import _drop as evict  # torch-free, like this probe (run from tests/gpu)

from weightcache.bench.gpu import raw_read_rate

MiB = 1 << 20
GB = 1e9
# (readers, MiB per read, back to front)
PATTERNS = [(32, 16, False), (32, 64, True), (32, 64, False), (64, 16, False), (128, 8, False),
            (32, 16, True)]


def _drop(path: Path) -> None:
    evict(path)
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def _write(path: Path, nbytes: int) -> float:
    block = os.urandom(64 * MiB)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for at in range(0, nbytes, len(block)):
            # each block differs, so nothing below can fold equal blocks
            fh.write(at.to_bytes(8, "little") + block[8:])
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def main() -> None:
    workdir = Path(os.environ.get("PROBE_DIR", "/var/tmp/wc-readsize"))
    workdir.mkdir(parents=True, exist_ok=True)
    nbytes = int(float(os.environ.get("PROBE_GB", "15")) * (1 << 30))
    rounds = int(os.environ.get("PROBE_ROUNDS", "2"))
    path = workdir / "blob"
    out: dict[str, Any] = {"bytes": nbytes, "rounds": rounds,
                           "write_s": round(_write(path, nbytes), 2), "reads": []}
    print("written", out["write_s"], flush=True)
    for r in range(rounds):
        for i in range(len(PATTERNS)):
            readers, mib, backward = PATTERNS[(i + r) % len(PATTERNS)]  # each round rotated
            _drop(path)
            got = raw_read_rate([path], readers, True, mib * MiB, backward)
            got["round"] = r
            out["reads"].append(got)
            print(json.dumps(got), flush=True)
    summary = {}
    for readers, mib, backward in PATTERNS:
        rates = [g["gb_per_s"] for g in out["reads"]
                 if (g["threads"], g["chunk_mib"], g["backward"]) == (readers, mib, backward)]
        summary[f"{readers}x{mib}MiB{' back' if backward else ''}"] = {
            "gb_per_s": rates, "median": round(statistics.median(rates), 3)}
    out["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)
    target = os.environ.get("PROBE_OUT")
    if target:
        Path(target).write_text(json.dumps(out, indent=1))
    path.unlink()


if __name__ == "__main__":
    main()
