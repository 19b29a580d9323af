"""A node's first start with and without the agent image's seed import set, on CPU (README.md).

Every step drops every cache first (`echo 3 > /proc/sys/vm/drop_caches`, as root) and runs the
real `weightcache preload --device cpu`; spawn to READY is `wall`. Steps, in turn, ROUNDS times:
`first` (no import set at all: the set file removed, no seed), `seeded` (the set file removed,
`WEIGHTCACHE_IMPORT_SET_SEED` naming a seed recorded once by `weightcache import-set record` in
a fresh process), `own` (the node's own set, written by an earlier start of its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORK = Path("/var/tmp/wc-seed")
MODEL = WORK / "model"
SEED = WORK / "image" / "import-set.json"
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def drop() -> None:
    from weightcache.native.shared.coldload import drop_page_cache

    assert drop_page_cache(sorted(MODEL.glob("*.safetensors")), everything=True), "needs root"


def preload(set_file: Path, env: dict[str, str]) -> dict[str, Any]:
    from weightcache.bench.load import Launcher

    sock = WORK / f"sock-{time.time_ns()}"
    sock.mkdir()
    launcher = Launcher(MODEL, sock, {"WEIGHTCACHE_IMPORT_SET": str(set_file), **env},
                        device="cpu")
    deadline = time.monotonic() + 20  # the rank writes its set right after READY
    while not set_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.stop()
    rank = launcher.ready["rank_loads"][0]
    prefetch = rank.get("import_prefetch") or {}
    return {"wall": round(launcher.wall, 3), "ready": launcher.ready.get("seconds"),
            "phases": rank.get("phases"),
            "prefetch": {k: prefetch.get(k) for k in ("files", "bytes", "resident_bytes",
                                                       "seconds", "seeded", "warm")}}


def main() -> None:
    from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

    WORK.mkdir(parents=True, exist_ok=True)
    if not MODEL.exists():
        write_llama_checkpoint(MODEL, LlamaShape(vocab=32000, hidden=2048, intermediate=5632,
                                                 layers=12, heads=16, kv_heads=4), files=4)
    done = subprocess.run([sys.executable, "-m", "weightcache.cli", "import-set", "record",
                           str(SEED)], capture_output=True, text=True, check=True)
    print("seed", done.stdout.strip(), flush=True)
    os.chdir(WORK)  # `python -m` puts the working directory first: never the repository root
    own = WORK / "own-set.json"
    own.unlink(missing_ok=True)
    drop()
    print("own-set written by", json.dumps(preload(own, {})), flush=True)
    for _ in range(ROUNDS):
        for name in ("first", "seeded", "own"):
            env = {"WEIGHTCACHE_IMPORT_SET_SEED": str(SEED)} if name == "seeded" else {}
            set_file = own if name == "own" else WORK / f"{name}-set.json"
            if name != "own":
                set_file.unlink(missing_ok=True)
            drop()
            print(name, json.dumps(preload(set_file, env)), flush=True)


if __name__ == "__main__":
    main()
