"""Probe: READY of a tensor-parallel preload with the checkpoint cold, the ranks' early reads
on (`WEIGHTCACHE_LOAD_EARLY_MIB=auto`, the default) against off (`0`, what a tensor-parallel
rank did before: it read nothing until its layout, and torch, were up), in turn.

    python3 tests/gpu/probe_tp_early.py DEVICE [TP] [ROUNDS] [GB]

DEVICE is cpu (memfd arenas) or cuda (TP GPUs). Writes a Llama-shaped checkpoint of about GB
(default 3) in PROBE_DIR (default /var/tmp), evicts its files from the page cache before each
start (posix_fadvise DONTNEED; the libraries stay in memory), and prints one JSON line per
start and a summary (PROBE_OUT: the whole report as JSON).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.coldload import drop_page_cache
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint
from weightcache.testing.processes import Preload

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
tp = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
gb = float(sys.argv[4]) if len(sys.argv) > 4 else 3.0
layers = max(1, round(gb * 1e9 / (2 * (4 * 2048 * 2048 + 3 * 2048 * 5632))))
shape = LlamaShape(hidden=2048, layers=layers, intermediate=5632, vocab=32000, heads=16,
                   kv_heads=16)
with tempfile.TemporaryDirectory(dir=os.environ.get("PROBE_DIR", "/var/tmp")) as tmp:
    model = write_llama_checkpoint(Path(tmp) / "m", shape, files=4)
    files = open_checkpoint(model).files
    size = sum(f.stat().st_size for f in files)
    print(json.dumps({"device": device, "tp": tp, "bytes": size, "files": len(files),
                      "layers": layers}), flush=True)
    rows = []
    for r in range(rounds):
        for budget in ("auto", "0") if r % 2 == 0 else ("0", "auto"):
            drop_page_cache(files, everything=False)
            sock = Path(tmp) / f"s-{r}-{budget}"
            sock.mkdir(mode=0o700)
            t = time.monotonic()
            p = Preload(["--model", str(model), "--weight-cache-socket-dir", str(sock),
                         "--tensor-parallel-size", str(tp), "--device", device],
                        env={**os.environ, "WEIGHTCACHE_LOAD_EARLY_MIB": budget})
            ready = p.wait_ready(600)
            wall = time.monotonic() - t
            p.stop()
            loads = ready["rank_loads"]
            row = {"early": budget, "wall_to_ready_s": round(wall, 3),
                   "ready_s": ready["seconds"],
                   "fill_s": [x["phases"]["fill_seconds"] for x in loads],
                   "startup_s": [x["phases"]["startup_seconds"] for x in loads],
                   "early_read_mb": [round((x["early"] or {}).get("read_bytes", 0) / 1e6, 1)
                                     for x in loads],
                   "early_taken_mb": [round(x["loader"]["early_bytes"] / 1e6, 1) for x in loads]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for budget in ("auto", "0"):
        walls = sorted(r["wall_to_ready_s"] for r in rows if r["early"] == budget)
        summary[f"early_{budget}_median_wall_s"] = walls[len(walls) // 2]
    summary["off_over_on"] = round(summary["early_0_median_wall_s"]
                                   / summary["early_auto_median_wall_s"], 3)
    print(json.dumps(summary), flush=True)
    if out := os.environ.get("PROBE_OUT"):
        Path(out).write_text(json.dumps({"rows": rows, **summary}, indent=2))
