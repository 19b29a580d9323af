"""Probe: does a cold import set read faster in the disk's own order?

A rank's start reads its import set (importset.py) before its early reads begin, and on the
H100 VMs that read went at about 0.4 GB/s (480-500 MB of small files) against 1.6-2.9 GB/s for
the checkpoint: the seconds a cold READY stays short of the device read. The set is read in
the order it was recorded (import order), by THREADS readers. Files an image's layer extracted
one after another tend to lie one after another on the disk, so reading them in the order of
their first physical block (FIEMAP) lets the block layer merge neighbours into larger
requests. This probe records a set the way the agent image's build does (`weightcache
import-set record`: the libraries evicted, then a rank's imports), then, with every cache
dropped before each read (root), reads it with `importset.Prefetch` in the recorded order and
in physical order, alternated, PROBE_ROUNDS times. On the 2-core development VM (virtio disk)
the two orders read alike (a 288 MB set in 0.389-0.436 s either way, 1,416 entries): that
disk, whose host caches it, says nothing of the VMs'.

    PROBE_DIR=/var/tmp/wc-order PROBE_OUT=/tmp/order.json python3 tests/gpu/probe_import_order.py
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightcache.native.shared import importset

FS_IOC_FIEMAP = 0xC020660B  # linux/fs.h: _IOWR('f', 11, struct fiemap)
_FIEMAP = "QQIIII"  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, pad
_EXTENT = 56  # struct fiemap_extent: fe_logical, fe_physical, fe_length, 2 x u64, 4 x u32


def first_block(path: str) -> int:
    """The physical byte offset of the file's first extent; large where unknown (last)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 1 << 62
    try:
        buf = bytearray(struct.calcsize(_FIEMAP) + _EXTENT)
        struct.pack_into(_FIEMAP, buf, 0, 0, 1 << 62, 0, 0, 1, 0)
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        if struct.unpack_from("I", buf, 20)[0] == 0:  # no extent: empty or inline
            return 1 << 61
        return int(struct.unpack_from("QQ", buf, struct.calcsize(_FIEMAP))[1])
    except OSError:
        return 1 << 60
    finally:
        os.close(fd)


def drop_caches() -> None:
    """Every cache, as a node's cold start finds it (root). Not `coldload.drop_page_cache`:
    importing it imports torch, whose mapped libraries then stay resident and out of the set's
    read (143 MB read instead of 288 on the development VM)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_once(files: list[dict[str, Any]], order: str) -> dict[str, Any]:
    drop_caches()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    pre = importset.Prefetch(files).start()
    pre.done.wait(120)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    got = pre._read  # the probe's look at the prefetch's own count
    return {"order": order, "seconds": round(seconds, 3), "read_mb": round(got / 1e6, 1),
            "gb_per_s": round(got / seconds / 1e9, 3), "files": len(files),
            "whole": pre.whole(), "cpu_s": round(after.ru_utime + after.ru_stime
                                                 - before.ru_utime - before.ru_stime, 3)}


def main() -> int:
    work = Path(os.environ.get("PROBE_DIR", "/var/tmp/wc-order"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = int(os.environ.get("PROBE_ROUNDS", "3"))
    seed = work / "import-set.json"
    subprocess.run([sys.executable, "-P", "-m", "weightcache.cli", "import-set", "record",
                    str(seed)], check=True, timeout=300)
    files = importset.load(seed, owners=(os.getuid(), 0))
    t0 = time.monotonic()
    blocks = {f["path"]: first_block(f["path"]) for f in files if not f.get("list")}
    fiemap_s = time.monotonic() - t0
    physical = sorted(files, key=lambda f: -1 if f.get("list") else blocks[f["path"]])
    rows = []
    for _ in range(rounds):
        for order, listed in (("recorded", files), ("physical", physical)):
            rows.append(read_once(listed, order))
            print(json.dumps(rows[-1]), flush=True)
    report = {"entries": len(files), "fiemap_seconds": round(fiemap_s, 3), "rows": rows}
    for order in ("recorded", "physical"):
        secs = sorted(r["seconds"] for r in rows if r["order"] == order)
        report[f"{order}_median_s"] = secs[len(secs) // 2]
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    if out := os.environ.get("PROBE_OUT"):
        Path(out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
