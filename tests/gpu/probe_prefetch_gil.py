"""Whether a rank's import set reads as fast beside its `import torch` as alone: the set's
read (importset.Prefetch, as a rank runs it) in a fresh process whose main thread, meanwhile,
does nothing (`alone`), imports torch (`import`, a rank's start), or holds the GIL in long C
calls and nothing else (`hold`: `sorted` of a large list, about a third of a second a call,
like the longest spans of `import torch`), each with the set's pages dropped first
(`POSIX_FADV_DONTNEED`: pages no other process maps leave the page cache); and the set read
in a process of its own while the main thread imports torch (`apart`,
`WEIGHTCACHE_IMPORT_SET_PROCESS=1`).

Why: with every cache dropped, the early reads wait for the set's read, and on an H100 VM
that read took 0.69-1.18 s while the disk sat idle for its last half second (run75-77): the
prefetch's threads need the GIL between their system calls, and the import holds it.

    python3 tests/gpu/probe_prefetch_gil.py OUT.json [ROUNDS]

Runs on CPU too. The set is recorded first, by a process that imports torch and transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("alone", "import", "hold", "apart")


def child(set_path: str, mode: str) -> None:
    from weightcache.native.shared import importset

    files = importset.load(Path(set_path))
    for f in files:
        try:
            fd = os.open(f["path"], os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    t0 = time.monotonic()
    prefetch = importset.Prefetch(files, deep=True).start(apart=mode == "apart")
    holds: list[float] = []
    if mode in ("import", "apart"):
        import torch  # noqa: F401

        holds.append(time.monotonic() - t0)
    elif mode == "hold":
        import random

        data = [random.random() for _ in range(1_500_000)]
        while not prefetch.done.is_set():
            h = time.monotonic()
            sorted(data)
            holds.append(time.monotonic() - h)
    prefetch.done.wait(120)
    stats = prefetch.stats()
    prefetch.close()
    print(json.dumps({"mode": mode, "prefetch_s": stats["seconds"], "files": stats["files"],
                      "of_files": len(files), "read_bytes": stats["bytes"],
                      "resident_bytes": stats["resident_bytes"],
                      "main_thread_s": round(max(holds), 3) if holds else None}))


def main(argv: list[str]) -> int:
    out, rounds = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 2
    work = Path(tempfile.mkdtemp(prefix="wc-probe-prefetch-"))
    set_path = work / "import-set.json"
    rec = subprocess.run(
        [sys.executable, "-c", "import torch, transformers, sys\n"
         "from pathlib import Path\n"
         "from weightcache.native.shared import importset\n"
         f"sys.exit(0 if importset.record(Path({str(set_path)!r})) else 1)"],
        capture_output=True, text=True, timeout=300)
    if rec.returncode != 0:
        print(rec.stdout + rec.stderr)
        return 1
    rows = []
    for n in range(rounds):
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--child", str(set_path), mode],
                                  capture_output=True, text=True, timeout=300)
            line = (proc.stdout.strip().splitlines() or [""])[-1]
            row = json.loads(line) if line.startswith("{") else {"mode": mode,
                                                                 "error": proc.stderr[-500:]}
            row["round"] = n + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main(sys.argv[1:]))
