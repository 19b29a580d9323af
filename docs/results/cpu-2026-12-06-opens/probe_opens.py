"""READY with the model cold on a many-file checkpoint, the tree before the early reads' opener
thread (PROBE_BASE, a directory holding that tree's `weightcache` package) against this tree,
in turn, on CPU (README.md).

Each step evicts only the checkpoint's files (`POSIX_FADV_DONTNEED`), runs the real `weightcache
preload --device cpu`, and prints spawn to READY (`wall`), READY's seconds, and the rank's
marks from the spawn: its lock, the early reads' first read, its import's end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = Path("/var/tmp/wc-opens")
MODEL = WORK / "model"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
FILES = int(os.environ.get("FILES", "1000"))  # capped at one tensor a file, as `many`


def evict() -> None:
    for f in MODEL.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def preload(env: dict[str, str]) -> dict[str, Any]:
    sock = WORK / f"sock-{time.time_ns()}"
    sock.mkdir()
    spawned = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(MODEL),
         "--device", "cpu", "--weight-cache-socket-dir", str(sock)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=WORK,
        env={**os.environ, **env})
    ready: dict[str, Any] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            wall = time.monotonic() - spawned
            ready = json.loads(line[6:])
            break
    else:
        raise RuntimeError(f"preload exited {proc.wait()} before READY")
    proc.terminate()
    proc.wait(30)
    rank = ready["rank_loads"][0]
    marks = rank.get("marks") or {}
    first = (rank.get("early") or {}).get("first_read_at")
    return {"wall": round(wall, 3), "ready": ready.get("seconds"),
            "locked": round(marks["locked"] - spawned, 4) if "locked" in marks else None,
            "first_read": round(first - spawned, 4) if first else None,
            "imported": round(marks["imported"] - spawned, 4) if "imported" in marks else None}


def main() -> None:
    from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

    WORK.mkdir(parents=True, exist_ok=True)
    if not MODEL.exists():
        write_llama_checkpoint(MODEL, LlamaShape(vocab=32000, hidden=2048, intermediate=5632,
                                                 layers=12, heads=16, kv_heads=4), files=FILES)
    print("files", len(list(MODEL.glob("*.safetensors"))), flush=True)
    # This tree is the venv's own (an editable install); the base comes first on PYTHONPATH.
    # The repository root itself must never be on sys.path: its operator/ shadows the stdlib.
    variants = {
        "base": {"PYTHONPATH": os.environ["PROBE_BASE"],
                 "WEIGHTCACHE_IMPORT_SET": str(WORK / "set-base.json")},
        "new": {"WEIGHTCACHE_IMPORT_SET": str(WORK / "set-new.json")},
    }
    for env in variants.values():  # each writes its import set; not counted
        evict()
        preload(env)
    for _ in range(ROUNDS):
        for name, env in variants.items():
            evict()
            print(name, json.dumps(preload(env)), flush=True)


if __name__ == "__main__":
    main()
