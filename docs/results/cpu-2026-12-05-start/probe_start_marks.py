"""READY of a real `weightcache preload --device cpu` with only the checkpoint dropped from the
page cache, and READY's start marks as seconds from this script's spawn of the launcher.

Usage: python probe_start_marks.py MODEL_DIR ROUNDS [TREE ...]
Each TREE (a directory holding a `weightcache` package; none: the installed one) runs in turn,
ROUNDS times, from a neutral working directory. Prints one JSON line per READY.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def once(model: str, tree: str | None) -> dict:
    for name in os.listdir(model):
        fd = os.open(os.path.join(model, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    env = {**os.environ, **({"PYTHONPATH": tree} if tree else {})}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "weightcache.cli", "preload", "--model", model,
                             "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd="/")
    row: dict = {"tree": tree or "installed"}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                row["wall_to_ready_s"] = round(time.monotonic() - t0, 3)
                ready = json.loads(line[6:])
                rank = ready["rank_loads"][0]
                marks = {f"launcher_{k}": v for k, v in (ready.get("marks") or {}).items()}
                marks.update(rank.get("marks") or {})
                early, pf = rank.get("early") or {}, rank.get("import_prefetch") or {}
                marks["early_first_read"] = early.get("first_read_at")
                marks["early_first_landed"] = early.get("first_landed_at")
                marks["prefetch_done"] = pf.get("done_at")
                row["marks"] = {k: round(v - t0, 3) for k, v in sorted(
                    marks.items(), key=lambda kv: kv[1] or 0) if isinstance(v, (int, float))}
                row["prefetch"] = {k: pf.get(k) for k in ("bytes", "checked_only", "seconds")}
                if "serving" in row["marks"]:
                    row["serving_to_ready_s"] = round(row["wall_to_ready_s"]
                                                      - row["marks"]["serving"], 3)
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return row


def main() -> int:
    model, rounds, trees = sys.argv[1], int(sys.argv[2]), sys.argv[3:] or [None]
    for _ in range(rounds):
        for tree in trees:
            print(json.dumps(once(model, tree)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
