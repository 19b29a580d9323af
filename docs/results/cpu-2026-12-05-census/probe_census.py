"""Time to the checkpoint's first read after a restart whose import set is partly out of the
page cache: a real `weightcache preload --device cpu`, with the census's warm verdict (the
default) and without it (`WEIGHTCACHE_IMPORT_SET_WARM=0`: the whole set read first), in turn.

Usage: python probe_census.py MODEL_DIR ROUNDS EVICT_SHARE
One import set for both (written by one READY that is not counted). Before every counted READY
the checkpoint's files are dropped from the page cache, and so are whole files of the set, in
the set's order, every other one that keeps what is dropped within EVICT_SHARE of its bytes
(what a restart finds: most of the set in memory, a part not; `posix_fadvise(DONTNEED)`, which
leaves pages that a process maps, so the census says what was really missing). Run from a
neutral working directory, the installed `weightcache`. Prints one JSON line per READY: the
marks (seconds from the spawn) and what the set's read-ahead found and read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

VARIANTS = {"warm": {}, "nowarm": {"WEIGHTCACHE_IMPORT_SET_WARM": "0"}}


def _evict(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _evict_share(set_file: str, share: float) -> int:
    """Drop whole files of the set, every other one in its order, each that keeps the bytes
    dropped within `share` of the set's."""
    with open(set_file) as fh:
        files = [f for f in json.load(fh)["files"] if "ranges" in f]
    total = sum(e - s for f in files for s, e in f["ranges"])
    dropped = 0
    for f in files[::2]:
        size = sum(e - s for s, e in f["ranges"])
        if dropped + size <= share * total:
            _evict(f["path"])
            dropped += size
    return dropped


def once(model: str, set_file: str, variant: str, share: float | None) -> dict:
    for name in os.listdir(model):
        _evict(os.path.join(model, name))
    asked = _evict_share(set_file, share) if share is not None else None
    env = {**os.environ, "WEIGHTCACHE_IMPORT_SET": set_file, **VARIANTS[variant]}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "weightcache.cli", "preload", "--model", model,
                             "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd="/")
    row: dict = {"variant": variant, "evicted_bytes_asked": asked}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                row["wall_to_ready_s"] = round(time.monotonic() - t0, 3)
                rank = json.loads(line[6:])["rank_loads"][0]
                early, pf = rank.get("early") or {}, rank.get("import_prefetch") or {}
                marks = dict(rank.get("marks") or {})
                marks.update({"early_first_read": early.get("first_read_at"),
                              "prefetch_census": pf.get("census_at"),
                              "prefetch_warm": pf.get("warm_at"),
                              "prefetch_done": pf.get("done_at")})
                row["marks"] = {k: round(v - t0, 3) for k, v in sorted(
                    marks.items(), key=lambda kv: kv[1] or 0) if isinstance(v, (int, float))}
                row["prefetch"] = {k: pf.get(k) for k in (
                    "files", "bytes", "resident_bytes", "warm", "checked_only", "looked_up",
                    "seconds")}
                break
        deadline = time.monotonic() + 10  # a rank writes its set just after READY
        while share is None and not os.path.exists(set_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return row


def main() -> int:
    model, rounds, share = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    set_file = os.path.join(os.path.dirname(os.path.abspath(model)), "import-set.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(set_file)
    print(json.dumps({"uncounted": once(model, set_file, "warm", None)}), flush=True)
    for _ in range(rounds):
        for variant in VARIANTS:
            print(json.dumps(once(model, set_file, variant, share)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
