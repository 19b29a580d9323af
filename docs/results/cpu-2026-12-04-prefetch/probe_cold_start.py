"""A rank's start with every cache dropped against only the model cold, on CPU (README.md).

Each argument is a step: `all:` (drop every cache, as root) or `model:` (evict only the
checkpoint's files), then comma-separated VAR=VALUE for the launcher's environment. One JSON
line per step: spawn to READY (`wall`), READY's seconds, the rank's phases, what its import
set's prefetch read, its early reads and its disk share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = Path("/var/tmp/wc-exp")
MODEL = WORK / "model"
SET = WORK / "import-set.json"


def drop(everything: bool) -> None:
    if everything:
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
        return
    for f in MODEL.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def preload(env: dict[str, str]) -> dict[str, Any]:
    sock = WORK / f"sock-{time.time_ns()}"
    sock.mkdir()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(MODEL),
         "--device", "cpu", "--weight-cache-socket-dir", str(sock)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "WEIGHTCACHE_IMPORT_SET": str(SET), **env})
    ready: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            wall = time.perf_counter() - t0
            ready = json.loads(line[6:])
            break
    else:
        raise RuntimeError(f"preload exited {proc.wait()} before READY")
    proc.terminate()
    proc.wait(30)
    rank = ready["rank_loads"][0]
    prefetch = rank.get("import_prefetch") or {}
    early = rank.get("early") or {}
    disk = (rank.get("loader") or {}).get("disk") or {}
    return {"wall": round(wall, 2), "ready": ready.get("seconds"), "phases": rank.get("phases"),
            "prefetch": {k: prefetch.get(k) for k in ("bytes", "seconds", "looked_up")},
            "early": {k: early.get(k) for k in ("read_bytes", "seconds", "waited_seconds")},
            "disk": {k: disk.get(k) for k in ("gentle_seconds", "fault_times")}}


def main(steps: list[str]) -> None:
    for step in steps:
        name, _, pairs = step.partition(":")
        env = dict(kv.split("=", 1) for kv in pairs.split(",") if kv)
        drop(name.startswith("all"))
        print(name, env, json.dumps(preload(env)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
