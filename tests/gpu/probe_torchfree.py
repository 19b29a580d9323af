"""How soon a process that never imports torch has a checkpoint on the GPU, digested, with every
cache dropped: against the device read and a real `weightcache preload` READY, in turn.

Why: with every cache dropped, a rank reads its import set (about 480 MB of torch's libraries,
1,477 files) before its early reads begin, and imports torch beside them; its READY trailed
the same run's model-cold READY by a median of 0.62 s over the committed runs 41-93. A rank
whose load path needs only the CUDA driver's bindings would read little besides the
checkpoint. This probe is that path's floor, not the product: a child process (`--child`)
imports `cuda.bindings.driver` and `blake3` only, creates the primary context, allocates the
whole checkpoint with `cuMemAlloc`, and has 32 threads read 16 MiB O_DIRECT pieces into two
pinned buffers each (`cuMemHostAlloc`), hash every 1 MiB content chunk with BLAKE3 (as the
fill does), and copy each piece to the device on the thread's own stream (`cuMemcpyHtoDAsync`,
an event per buffer). The parent times it from the spawn, and reports its phases.

Measured on an H100 VM (run95, docs/results/gpu-h100-2026-12-07): the first byte 0.29-0.42 s
after the spawn, done in 9.05-9.93 s, 0.744-0.816 of the faster device read: with one read in
flight a thread it read slower than the device read's 32 x 64 MiB, so the rank's libraries
are not all that stands between READY and the disk.

Run: `tests/gpu/run_device.sh probe_torchfree` (PROBE_ROUNDS, default 3; PROBE_LAYOUT,
default `sharded`). Root for `drop_caches`, as the load bench.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 16 << 20
PIECE = 1 << 20  # the content digest's chunk
THREADS = 32


def child(paths: list[str]) -> int:  # pragma: no cover  (GPU only)
    started = time.monotonic()
    import ctypes

    import blake3
    from cuda.bindings import driver as cu

    def ok(result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return values[0] if len(values) == 1 else values

    marks = {"imported": time.monotonic()}
    ok(cu.cuInit(0), "cuInit")
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    marks["context"] = time.monotonic()
    sizes = [os.stat(p).st_size for p in paths]
    total = sum(s + (-s) % 4096 for s in sizes)
    base = int(ok(cu.cuMemAlloc(total), "cuMemAlloc"))
    marks["allocated"] = time.monotonic()
    jobs: list[tuple[int, int, int, int]] = []  # (file index, offset, nbytes, device offset)
    at = 0
    for i, size in enumerate(sizes):
        for off in range(0, size, CHUNK):
            jobs.append((i, off, min(CHUNK, size - off), at + off))
        at += size + (-size) % 4096
    lock = threading.Lock()
    state = {"next": 0, "hashed": 0, "first_read": None}
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING),
                        "cuStreamCreate")
            bufs, events = [], [None, None]
            for _ in range(2):
                ptr = int(ok(cu.cuMemHostAlloc(CHUNK, 0), "cuMemHostAlloc"))
                bufs.append((ptr, memoryview((ctypes.c_char * CHUNK).from_address(ptr)).cast("B")))
            fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
            turn = 0
            while True:
                with lock:
                    n = state["next"]
                    state["next"] += 1
                if n >= len(jobs):
                    break
                i, off, nbytes, dst = jobs[n]
                if events[turn] is not None:
                    ok(cu.cuEventSynchronize(events[turn]), "cuEventSynchronize")
                ptr, view = bufs[turn]
                want = nbytes + (-nbytes) % 4096
                with lock:
                    state["first_read"] = state["first_read"] or time.monotonic()
                got = os.preadv(fds[i], [view[:want]], off)
                if got < nbytes:
                    raise OSError(f"short read {got} < {nbytes}")
                for p in range(0, nbytes, PIECE):
                    blake3.blake3(view[p:min(nbytes, p + PIECE)]).digest()
                ok(cu.cuMemcpyHtoDAsync(base + dst, ptr, nbytes, stream), "cuMemcpyHtoDAsync")
                if events[turn] is None:
                    events[turn] = ok(cu.cuEventCreate(
                        cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                ok(cu.cuEventRecord(events[turn], stream), "cuEventRecord")
                turn ^= 1
            ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marks["done"] = time.monotonic()
    marks["first_read"] = state["first_read"]
    if errors:
        raise errors[0]
    print("DONE " + json.dumps({
        "bytes": sum(sizes), "started": started,
        "marks_s": {k: round(v - started, 4) for k, v in marks.items() if v is not None}}),
        flush=True)
    return 0


def run_child(files: list[Path]) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--child", *map(str, files)],
                          capture_output=True, text=True, timeout=180)
    wall = time.monotonic() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("DONE ")), None)
    if proc.returncode or line is None:
        return {"error": (proc.stdout + proc.stderr)[-1500:], "wall_s": round(wall, 3)}
    out = json.loads(line[5:])
    spawned = out.pop("started") - t0  # one clock (CLOCK_MONOTONIC) for both processes
    out["interpreter_s"] = round(spawned, 4)
    out["wall_s"] = round(spawned + out["marks_s"]["done"], 3)  # as READY: not the exit
    out["exit_wall_s"] = round(wall, 3)
    return out


def main() -> int:
    import torch

    from weightcache.bench import gpu as g
    from weightcache.bench import load

    load.DEVICE = "cuda"
    rounds = int(os.environ.get("PROBE_ROUNDS", "3"))
    work = Path(os.environ.get("PROBE_DIR") or tempfile.mkdtemp(prefix="wc-torchfree-"))
    work.mkdir(parents=True, exist_ok=True)
    layout = os.environ.get("PROBE_LAYOUT", "sharded")
    model = load.build_model(load.LLAMA_8B)
    path = work / layout
    out: dict[str, Any] = {"rounds": rounds, "layout": layout,
                           "checkpoint": load.write_layout(model, layout, path, None),
                           "torchfree": [], "preload": []}
    del model
    torch.cuda.empty_cache()
    files = g._files(path)
    # The rank writes its import set just after READY, where the bench's `preload_once` waits
    # for it (`_wait_for_import_set`: on the path this names). Unnamed, run95's READYs were
    # each a node's first start, with no set.
    os.environ.setdefault("WEIGHTCACHE_IMPORT_SET", str(work / "import-set.json"))
    os.chdir(work)
    load.drop(files)
    reads = [g.raw_read_rate(files, 32, True).get("seconds")]
    print(json.dumps({"direct_cold_s": reads[0]}), flush=True)
    load.preload_once(path, files, True)  # writes the node's import set; not counted
    for n in range(rounds):
        order = ("torchfree", "preload") if n % 2 == 0 else ("preload", "torchfree")
        for name in order:
            load.drop(files)
            if name == "torchfree":
                row = run_child(files)
            else:
                ready = load.preload_once(path, files, True)
                row = {"wall_s": ready.get("wall_to_ready_s"),
                       "ready_s": (ready.get("ready") or {}).get("seconds"),
                       "first_read_s": (ready.get("start_marks") or {}).get("early_first_read")}
            out[name].append(row)
            print(json.dumps({name: row}), flush=True)
    load.drop(files)
    reads.append(g.raw_read_rate(files, 32, True).get("seconds"))
    best = min(x for x in reads if x)
    out["device_reads_s"] = reads
    for name in ("torchfree", "preload"):
        walls = [r["wall_s"] for r in out[name] if r.get("wall_s") and "error" not in r]
        if walls:
            out[f"{name}_wall_s"] = walls
            out[f"{name}_wall_median_s"] = round(statistics.median(walls), 3)
            out[f"{name}_vs_device_read"] = [round(best / w, 3) for w in walls]
    print(json.dumps({k: v for k, v in out.items() if k not in ("torchfree", "preload")}),
          flush=True)
    if target := os.environ.get("PROBE_OUT"):
        Path(target).write_text(json.dumps(out, indent=1))
    if not os.environ.get("PROBE_DIR"):
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
