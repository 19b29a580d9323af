"""The start sampler names what a watched process waits on (weightcache/bench/waits.py).

A real launcher-like parent starts a real child whose command line marks it as a rank; the
child spins on the CPU, then blocks opening a FIFO the test holds shut. The sampler must find
the child through the parent and tell the two apart by their classes, the open named by the
FIFO's own path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightcache.bench.waits import RANK_MARK, StartWaits

CHILD = r"""
import os, sys, time
fifo, flag = sys.argv[1], sys.argv[2]
end = time.monotonic() + 0.6
while time.monotonic() < end:
    pass
with open(fifo, "rb") as f:  # blocks until the test opens the write end
    f.read()
end = time.monotonic() + 5
while time.monotonic() < end and not os.path.exists(flag + ".stop"):
    time.sleep(0.001)
"""
PARENT = r"""
import subprocess, sys
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[1], *sys.argv[2:]]))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sampler_finds_the_rank_and_names_its_waits(tmp_path: Path) -> None:
    fifo, flag = tmp_path / "fifo", tmp_path / "flag"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(fifo), str(flag),
                               RANK_MARK])
    waits = StartWaits(parent.pid, t0, interval=0.005)
    try:
        time.sleep(1.6)  # the spin (0.6 s after its interpreter starts), then the FIFO
        with open(fifo, "wb"):
            pass
        time.sleep(0.3)
        flag.with_suffix(".stop").touch()
        assert parent.wait(timeout=10) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
    report = waits.stop(rank_start_until=1.5)
    rank = report["rank"]["seconds"]
    assert rank.get("cpu", 0) >= 0.3, rank
    fifo_wait = rank.get(f"sleep openat {fifo}", 0)  # open blocks until a writer opens
    assert fifo_wait >= 0.3, rank
    # The launcher-like parent only waits for its child.
    launcher = report["launcher"]["seconds"]
    assert max(launcher, key=launcher.get) == "sleep wait4", launcher
    # The start window stops where it was told to: the FIFO was released after 1.6 s.
    start = report["rank_start"]
    assert start["to_s"] <= 1.5 and "timeline" not in start
    assert start["seconds"].get(f"sleep openat {fifo}", 0) < fifo_wait
    rows = report["rank"]["timeline"]["rows"]
    assert any(row[1] == f"sleep openat {fifo}" for row in rows), rows
