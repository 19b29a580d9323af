"""READY with the model cold, this tree against a base tree, alternated in one run, and where
the time before the first byte goes.

Each READY is a real `weightcache preload` of the 8B-shaped checkpoint (16 GB; PROBE_LAYOUT,
default `sharded`: four `save_pretrained` shards; `single` or `many` as `weightcache bench load`
writes them) with only the checkpoint dropped from the page cache. With
PROBE_BASE (a directory holding a `weightcache` package: the base tree), the base runs with
that directory first on PYTHONPATH, in turn with this tree, PROBE_ROUNDS times each, after one
READY of each that is not counted (each writes its own import set). The device read (32 x 64
MiB O_DIRECT) before and after bounds READY. This tree's READY carries `marks`: printed as
seconds from the spawn (`bench/load.start_marks`), with the disk's first second. Also times
the driver's start in fresh processes (`import cuda.bindings.driver`, `cuInit`, one UUID),
which the launcher and, before it was handed its UUID, every rank paid before the first read.

Run: `tests/gpu/run_device.sh probe_ready_start` (PROBE_ROUNDS, default 2; PROBE_BASE;
PROBE_LAYOUT).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DRIVER_START = """
import time
t0 = time.monotonic()
from cuda.bindings import driver as cu
t1 = time.monotonic()
cu.cuInit(0)
t2 = time.monotonic()
from weightcache.native.shared.gpu import visible_device_uuids
uuids = visible_device_uuids()
t3 = time.monotonic()
print({"import_s": round(t1 - t0, 4), "cuinit_s": round(t2 - t1, 4),
       "uuids_s": round(t3 - t2, 4), "devices": len(uuids or [])})
"""


def _row(variant: str, ready: dict[str, Any], load: Any) -> dict[str, Any]:
    r = ready.get("ready") or {}
    rank = load._rank0(r)
    early = rank.get("early") or {}
    disk = (ready.get("disk_timeline") or {}).get("rows") or []
    return {"variant": variant, "wall_to_ready_s": ready.get("wall_to_ready_s"),
            "ready_seconds": r.get("seconds"), "phases": rank.get("phases"),
            "early_bytes": early.get("read_bytes"),
            "marks": ready.get("start_marks"),
            "start_waits": load._start_waits(ready.get("waits")),
            "import_prefetch": {k: (rank.get("import_prefetch") or {}).get(k)
                                for k in ("files", "bytes", "checked_only", "warm",
                                          "seconds")},
            "gentle_s": ((rank.get("loader") or {}).get("disk") or {}).get("gentle_seconds"),
            "disk_first_s": [row[:2] for row in disk[:6]]}


def main() -> int:
    import torch

    from weightcache.bench import gpu as g
    from weightcache.bench import load

    load.DEVICE = "cuda"
    rounds = int(os.environ.get("PROBE_ROUNDS", "2"))
    base = os.environ.get("PROBE_BASE")
    work = Path(os.environ.get("PROBE_DIR") or tempfile.mkdtemp(prefix="wc-ready-start-"))
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"rounds": rounds, "base": base, "ready": [], "driver_start": []}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", DRIVER_START], capture_output=True,
                              text=True, timeout=60)
        out["driver_start"].append(done.stdout.strip() or done.stderr.strip()[-300:])
    print(json.dumps({"driver_start": out["driver_start"]}), flush=True)
    layout = os.environ.get("PROBE_LAYOUT", "sharded")
    out["layout"] = layout
    model = load.build_model(load.LLAMA_8B)
    path = work / layout
    out["checkpoint"] = load.write_layout(model, layout, path, None)
    del model
    torch.cuda.empty_cache()
    files = g._files(path)
    variants: dict[str, dict[str, str]] = {
        "new": {"WEIGHTCACHE_IMPORT_SET": str(work / "import-set-new.json")}}
    if base:
        variants["base"] = {
            "WEIGHTCACHE_IMPORT_SET": str(work / "import-set-base.json"),
            "PYTHONPATH": base + os.pathsep + os.environ.get("PYTHONPATH", "")}
    os.chdir(work)  # `python -m` puts the working directory first: no tree may win by it
    load.drop(files)
    out["direct_cold_s"] = g.raw_read_rate(files, 32, True).get("seconds")
    print(json.dumps({"direct_cold_s": out["direct_cold_s"], **out["checkpoint"]}), flush=True)
    for env in variants.values():
        load.preload_once(path, files, "model", env)  # writes its import set; not counted
    for _ in range(rounds):
        for name in sorted(variants):
            row = _row(name, load.preload_once(path, files, "model", variants[name]), load)
            out["ready"].append(row)
            print(json.dumps(row), flush=True)
    load.drop(files)
    out["direct_cold_again_s"] = g.raw_read_rate(files, 32, True).get("seconds")
    best = min(x for x in (out["direct_cold_s"], out["direct_cold_again_s"]) if x)
    out["device_read_s"] = best
    for name in variants:
        walls = [r["wall_to_ready_s"] for r in out["ready"] if r["variant"] == name]
        if walls:
            out[f"{name}_wall_median_s"] = round(statistics.median(walls), 3)
            out[f"{name}_wall_vs_device_read"] = round(best / statistics.median(walls), 3)
    print(json.dumps({k: v for k, v in out.items() if k != "ready"}), flush=True)
    if target := os.environ.get("PROBE_OUT"):
        Path(target).write_text(json.dumps(out, indent=1))
    if not os.environ.get("PROBE_DIR"):
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
