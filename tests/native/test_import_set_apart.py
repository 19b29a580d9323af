"""A rank's import set read in a process of its own (`WEIGHTCACHE_IMPORT_SET_PROCESS=1`).

Real files, a real page cache, a real fork: each case runs in a fresh interpreter, since a
prefetch forks only where its process runs no other thread (pytest's do).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tests.native.test_import_set import PAGE, _entry, _file, _resident
from tests.native.test_import_set import _warm_file as _warm
from weightcache.native.shared import importset

# Runs in a fresh interpreter: the set's entries from argv[1] (JSON), the prefetch started
# apart, and what it did as one JSON line.
SCRIPT = r"""
import json, os, sys, time
from weightcache.native.shared import diskshare, importset
from weightcache.native.shared.residency import resident
files = json.loads(sys.argv[1])
stop_at_once = sys.argv[2] == "stop"
pf = importset.Prefetch(files).start(apart=True)
pid = pf.child
out = {"apart": pf.apart, "child": pid}
if stop_at_once:
    pf.stop()
    out["done"] = pf.done.wait(30)
    out["child_gone"] = pid is None or not os.path.exists(f"/proc/{pid}")
    out["child_after"] = pf.child
    print(json.dumps(out)); sys.exit(0)
diskshare.count_as_own(pid, reads=True)
share = diskshare.DiskShare()
out["done"] = pf.done.wait(30)
out["resident"] = []
for f in files:  # at once: a node's proactive reclaim (DAMON) may take idle pages later
    fd = os.open(f["path"], os.O_RDONLY)
    try:
        out["resident"].append(resident(fd, 0, os.fstat(fd).st_size))
    finally:
        os.close(fd)
deadline = time.monotonic() + 10
while pid is not None and time.monotonic() < deadline:  # the child exits after its line
    with open(f"/proc/{pid}/stat") as fh:
        if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
            break
    time.sleep(0.01)
out["zombie_reads"] = diskshare.read_own_reads(f"/proc/{pid}/io") if pid else None
out["own_reads"] = diskshare.read_own_reads()
out["share_own_reads"] = share._own_reads()
out["stats"] = pf.stats()
out["whole"] = pf.whole()
pf.close()
diskshare.forget_own(pid)
out["reaped"] = pf.child is None and not os.path.exists(f"/proc/{pid}")
out["after_reap_own_reads"] = diskshare.read_own_reads()
out["forgotten"] = diskshare.DiskShare().kin_io == ()
print(json.dumps(out))
"""


def _run(files: list[dict], how: str = "read") -> dict:
    proc = subprocess.run([sys.executable, "-P", "-c", SCRIPT, json.dumps(files), how],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cold_set_is_read_by_a_child_whose_reads_count_as_the_ranks_until_reaped(tmp_path):
    """A cold set (the census's verdict): the child reads all of it into the page cache and
    reports what it read; it stays a zombie until `close`, so a share that counts it as its
    own (`count_as_own(reads=True)`) sees its reads; once reaped, the kernel adds them to this
    process's, and shares made after `forget_own` no longer name it."""
    cold = [_file(tmp_path / f"c{i}.so", 256) for i in range(8)]
    out = _run([_entry(f) for f in cold])
    assert out["apart"] is True and out["child"] > 0 and out["done"] is True, out
    stats = out["stats"]
    assert stats["apart"] is True and stats["warm"] is False and out["whole"] is True, stats
    assert stats["files"] == 8 and stats["unread"] == 0
    assert stats["bytes"] == 8 * 256 * PAGE, stats
    assert all(out["resident"]), out["resident"]
    if out["zombie_reads"] is not None and out["zombie_reads"] > 0:  # proc_pid_io(5) counts
        assert out["share_own_reads"] >= out["own_reads"] + out["zombie_reads"]
        assert out["after_reap_own_reads"] >= out["own_reads"] + out["zombie_reads"]
    assert out["reaped"] is True and out["forgotten"] is True


def test_a_warm_verdict_hands_the_lacking_files_back_to_be_read_here(tmp_path):
    """A set in memory but for a small part: the child's census says which files lack pages,
    and this process reads them (the warm verdict, `early_go` before the read), as a prefetch
    on its own threads does."""
    warm = [_warm(tmp_path / f"w{i}.so", 64) for i in range(4)]
    if not all(_resident(f) for f in warm):
        pytest.skip("this kernel keeps no page cache for the test's files")
    cold = _file(tmp_path / "cold.so", 16)
    out = _run([_entry(f) for f in (*warm, cold)])
    stats = out["stats"]
    assert out["apart"] is True and out["done"] is True and out["whole"] is True, out
    assert stats["warm"] is True and stats["checked_only"] is False, stats
    assert stats["bytes"] == 16 * PAGE and stats["resident_bytes"] == 4 * 64 * PAGE, stats
    assert stats["started_at"] <= stats["census_at"] <= stats["warm_at"] <= stats["done_at"]
    assert out["resident"][-1] is True and out["reaped"] is True


def test_a_stopped_prefetch_kills_and_reaps_its_child(tmp_path):
    """`stop()` (a rank told to stop while it starts): the child is killed and reaped, and the
    prefetch is done."""
    cold = [_file(tmp_path / f"c{i}.so", 2048) for i in range(4)]
    out = _run([_entry(f) for f in cold], "stop")
    assert out["apart"] is True and out["done"] is True, out
    assert out["child_gone"] is True and out["child_after"] is None, out


def test_a_process_running_other_threads_reads_on_its_own_threads(tmp_path):
    """A fork copies only the calling thread, so a prefetch never forks where other threads
    run (as in this test's process): it reads here, as the default does."""
    cold = [_file(tmp_path / f"c{i}.so", 16) for i in range(2)]
    gate = threading.Event()
    other = threading.Thread(target=gate.wait, daemon=True)
    other.start()
    try:
        pf = importset.Prefetch([_entry(f) for f in cold]).start(apart=True)
        assert pf.done.wait(30)
    finally:
        gate.set()
    assert pf.apart is False and pf.child is None and pf.stats()["apart"] is False
    assert pf.whole() and all(_resident(f) for f in cold)


def test_the_process_knob_is_off_by_default_and_lenient(monkeypatch):
    """`WEIGHTCACHE_IMPORT_SET_PROCESS`: 1/true/yes on, anything else off."""
    for text, want in (("", False), ("1", True), ("yes", True), ("0", False), ("junk", False)):
        monkeypatch.setenv(importset.PROCESS_ENV, text)
        assert importset.reads_apart() is want
