"""READY's start marks on the CPU (memfd), the model cold and the libraries in memory: how
long the rank's main thread took from its lock to the start of its import (`locked` to
`early_started`, where it starts the early readers), and READY.

    python docs/results/cpu-2026-12-05-start-threads/probe_start_marks.py WORKDIR N

writes a 0.57 GB `save_pretrained` checkpoint (the load bench's CPU shape) under WORKDIR once,
then runs one READY to write the import set and N more, each printed as a line of marks
(seconds from the launcher's spawn) and READY's seconds.
"""

import json
import os
import sys
from pathlib import Path

from weightcache.bench import gpu as g
from weightcache.bench import load as bench

bench.DEVICE = "cpu"
work, runs = Path(sys.argv[1]), int(sys.argv[2])
path = work / "model"
if not path.exists():
    bench.write_layout(bench.build_model(bench.LLAMA_CPU), "sharded", path, None)
files = g._files(path)
os.environ.setdefault("WEIGHTCACHE_IMPORT_SET", str(work / "import-set.json"))
bench.preload_once(path, files, "model")  # writes the import set
keys = ["launcher_spawned", "locked", "early_first_read", "early_started", "imported", "serving"]
for _ in range(runs):
    found = bench.preload_once(path, files, "model")
    marks = found.get("start_marks") or {}
    print(json.dumps({k: marks.get(k) for k in keys}), "ready", found["ready"]["seconds"],
          flush=True)
