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
import time
from pathlib import Path
from typing import Any

WORK = Path("/var/tmp/wc-opens")
MODEL = WORK / "model"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
FILES = int(os.environ.get("FILES", "1000"))  # capped at one tensor a file, as `many`


def evict() -> None:
    from weightcache.native.shared.coldload import drop_page_cache

    drop_page_cache(sorted(MODEL.glob("*.safetensors")), everything=False)


def preload(env: dict[str, str]) -> dict[str, Any]:
    from weightcache.bench.load import Launcher

    sock = WORK / f"sock-{time.time_ns()}"
    sock.mkdir()
    launcher = Launcher(MODEL, sock, env, device="cpu")
    launcher.stop()
    marks = launcher.summary()["start_marks"]  # seconds from the spawn
    return {"wall": round(launcher.wall, 3), "ready": launcher.ready.get("seconds"),
            **{k: marks.get(m) for k, m in (("locked", "locked"),
                                            ("first_read", "early_first_read"),
                                            ("imported", "imported"))}}


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
    os.chdir(WORK)  # `python -m` puts the working directory first: never the repository root
    for env in variants.values():  # each writes its import set; not counted
        evict()
        preload(env)
    for _ in range(ROUNDS):
        for name, env in variants.items():
            evict()
            print(name, json.dumps(preload(env)), flush=True)


if __name__ == "__main__":
    main()
