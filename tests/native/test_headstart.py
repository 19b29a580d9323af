"""The launcher's head start: the checkpoint's first bytes asked of the disk before the rank
reads, left by the rank's early reads to the fill.

Real files, a real page cache (`POSIX_FADV_DONTNEED`, `cachestat`/`mincore` through
`residency`), and the real launcher and rank for the round trip.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.native.engine.attach import query
from weightcache.native.shared import content, importset, loadenv
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.coldload import drop_page_cache
from weightcache.native.shared.earlyread import (
    READ_JOBS,
    EarlyReads,
    cover_spans,
    grid_span,
    span_of,
)
from weightcache.native.shared.headstart import HeadStart, extents
from weightcache.native.shared.residency import resident, resident_pages
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

from .conftest import wait_until
from .test_import_set import _entry, _file, _resident, _warm_file

MiB = 1 << 20
CHUNK = 2 * MiB  # jobs of 1 MiB (grid_span(span_of(2 MiB))): several groups a file
# About 11 MB a file in three: several groups of jobs each.
SMALL = LlamaShape(hidden=512, layers=4, intermediate=1536, vocab=4096, heads=8, kv_heads=4,
                   tied=False)


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 9 * MiB), min_size=1, max_size=4),
       asked=st.integers(0, 40 * MiB))
def test_extents_are_whole_groups_front_to_back_and_name_themselves_again(
        tmp_path_factory, sizes, asked):
    """The launcher's asks and the rank's skips are one function of the files and a byte
    count: whole groups of READ_JOBS jobs from each file's start, in name order, never a
    later file before an earlier one is whole, never more than asked; and the sum it names
    names the same ranges again (what the rank gets is that sum)."""
    d = tmp_path_factory.mktemp("ext")
    files = [_sparse(d / f"model-{i:05d}.safetensors", n) for i, n in enumerate(sizes)]
    span = grid_span(span_of(CHUNK))
    got = extents(list(reversed(files)), asked, CHUNK)  # any order in: name order out
    assert list(got) == sorted(got) and sum(got.values()) <= asked
    paths = sorted(files)
    for i, path in enumerate(paths):
        spans = cover_spans(path.stat().st_size, span)
        ends = {spans[min(j + READ_JOBS, len(spans)) - 1][1]
                for j in range(0, len(spans), READ_JOBS)}
        if path in got:
            assert got[path] in ends  # a group's end
        if i and paths[i] in got:  # a later file only once every earlier one is whole
            assert all(got.get(p, 0) == p.stat().st_size for p in paths[:i])
    assert extents(files, sum(got.values()), CHUNK) == got


def test_the_knob_is_checked_for_a_rank_and_lenient_for_a_launcher(monkeypatch):
    monkeypatch.delenv(loadenv.HEAD_START_ENV, raising=False)
    assert loadenv.head_start() == loadenv.DEFAULT_HEAD_START_MIB * MiB
    monkeypatch.setenv(loadenv.HEAD_START_ENV, "0")
    assert loadenv.head_start() == 0 and HeadStart().verdict == "off"
    loadenv.check()
    for bad in ("-1", "lots", str(loadenv.MAX_HEAD_START_MIB + 1)):
        monkeypatch.setenv(loadenv.HEAD_START_ENV, bad)
        with pytest.raises(ValueError, match=loadenv.HEAD_START_ENV):
            loadenv.check()
        assert loadenv.head_start() == loadenv.DEFAULT_HEAD_START_MIB * MiB





def test_a_set_looks_warm_by_its_largest_files(tmp_path):
    """The launcher's verdict (`looks_warm`) weighs the set's largest files, as the census
    weighs all: a set whose big libraries are in memory is warm although small files lack;
    one whose big libraries are out is not; an empty set never is."""
    big = [_warm_file(tmp_path / f"big{i}.so", 64) for i in range(3)]
    fd = os.open(big[0], os.O_RDONLY)
    kept = resident(fd, 0, big[0].stat().st_size)
    os.close(fd)
    if not kept:
        pytest.skip("this kernel keeps no page cache for the test's files")
    small = [_file(tmp_path / f"small{i}.pyc", 1) for i in range(6)]
    files = [_entry(f) for f in (*big, *small)]
    assert importset.looks_warm(files, sample=8)
    drop_page_cache(big, everything=False)
    fd = os.open(big[0], os.O_RDONLY)
    dropped = (resident_pages(fd, 0, big[0].stat().st_size) or (1, 1))[0] == 0
    os.close(fd)
    if not dropped:
        pytest.skip("this file system keeps the pages (tmpfs?)")
    assert not importset.looks_warm(files, sample=8)
    assert not importset.looks_warm([])
    assert not importset.looks_warm([{"path": str(tmp_path), "list": True}])


def test_the_early_reads_leave_the_head_starts_jobs_to_the_fill(tmp_path, monkeypatch):
    """Jobs within the launcher's asks are never read early, whether the page cache holds
    them yet or not (the kernel may still be reading them): the fill takes them itself
    (`take` answers None), and every other job is read early as before."""
    monkeypatch.delenv("WEIGHTCACHE_EARLY_READ_JOBS", raising=False)
    model = write_llama_checkpoint(tmp_path / "m", SMALL, files=3)
    files = open_checkpoint(model).files
    total = sum(f.stat().st_size for f in files)
    ahead = extents(files, files[0].stat().st_size + 5 * MiB, CHUNK)
    assert len(ahead) == 2 and sum(ahead.values()) < total  # one whole file and a part
    drop_page_cache(files, everything=False)  # nothing resident: all would be read early
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=2, direct=False,
                       ahead=ahead).start()
    early.join()
    stats = early.stop()
    assert stats["ahead_bytes"] == sum(ahead.values())
    assert stats["read_bytes"] + stats["resident_bytes"] == total - sum(ahead.values())
    span = grid_span(span_of(CHUNK))
    for path, end in ahead.items():
        for start, stop in cover_spans(path.stat().st_size, span):
            if stop <= end:
                assert not early.holds(path, start, stop)
                assert early.take(path, start, stop) is None
            else:
                assert early.holds(path, start, stop)
    early.close()


def test_a_restart_asks_its_head_start_and_serves_the_same_content(tmp_path, sock_dir, preload):
    """Through the real launcher and rank. A node's first start has no import set: no head
    start. A restart finds its set in memory and the model cold: the launcher asks for the
    first bytes, in whole early-read groups, before the rank runs, READY says so, and the
    rank's early reads leave exactly those bytes to the fill. The content served is the
    files' audit digest either way; off by the knob, nothing is asked."""
    model = write_llama_checkpoint(tmp_path / "m", SMALL, files=3)
    files = open_checkpoint(model).files
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "WEIGHTCACHE_LOAD_CHUNK_MIB": str(CHUNK // MiB),
           "WEIGHTCACHE_LOAD_EARLY_MIB": "auto",
           loadenv.HEAD_START_ENV: "6"}
    env.pop(importset.ENV, None)
    args = ("--model", str(model), "--weight-cache-socket-dir", str(sock_dir))
    digest = content.content_root(content.digest_files(files))

    p = preload(*args, env=env)
    first = p.wait_ready(120)
    assert first["head_start"]["verdict"] in ("empty set", "no set")
    assert first["head_start"]["asked_bytes"] == 0
    assert first["rank_loads"][0]["early"]["ahead_bytes"] == 0
    set_file = tmp_path / "cache" / "weightcache" / importset.SET_NAME
    deadline = time.monotonic() + 60
    while not set_file.exists():
        assert time.monotonic() < deadline, "the rank wrote no import set"
        time.sleep(0.1)
    p.stop()

    drop_page_cache(files, everything=False)
    p = preload(*args, env=env)
    ready = p.wait_ready(120)
    head, rank = ready["head_start"], ready["rank_loads"][0]
    assert head["verdict"] == "asked", head
    want = extents(files, 6 * MiB, CHUNK)
    assert head["asked_bytes"] == sum(want.values()) > 0 and head["files"] == len(want)
    assert rank["early"]["ahead_bytes"] == head["asked_bytes"]
    marks = ready["marks"]
    assert marks["validated"] <= marks["head_asking"] <= marks["head_asked"]
    assert query(ready["sockets"][0], "hello")["content"] == digest
    p.stop()

    drop_page_cache(files, everything=False)
    p = preload(*args, env={**env, loadenv.HEAD_START_ENV: "0"})
    off = p.wait_ready(120)
    assert off["head_start"] == {"verdict": "off", "budget_bytes": 0, "asked_bytes": 0,
                                 "files": 0}
    assert off["rank_loads"][0]["early"]["ahead_bytes"] == 0
    assert query(off["sockets"][0], "hello")["content"] == digest


def _set_file(path: Path, libraries: list[Path]) -> Path:
    path.write_text(json.dumps({"version": importset.VERSION,
                                "files": [_entry(f) for f in libraries]}))
    path.chmod(0o600)
    return path


def test_the_launchers_verdict_decides_what_it_asks(tmp_path, monkeypatch):
    """The launcher's side alone, on real files: a set whose libraries are in memory gets the
    checkpoint's first groups asked of the disk (in the page cache once the asks are done,
    where they were not before); a cold set, tensor-parallel ranks, or a look that never
    came (`late`) ask nothing, and say why; with `WEIGHTCACHE_LOAD_HEAD_START_COLD=1` a cold
    set is asked for too."""
    monkeypatch.delenv("WEIGHTCACHE_EARLY_READ_JOBS", raising=False)
    monkeypatch.delenv(importset.SEED_ENV, raising=False)
    libs = [_warm_file(tmp_path / f"lib{i}.so", 64) for i in range(2)]
    model = write_llama_checkpoint(tmp_path / "m", SMALL, files=3)
    files = open_checkpoint(model).files
    budget = files[0].stat().st_size + 5 * MiB
    want = extents(files, budget, CHUNK)
    monkeypatch.setenv("WEIGHTCACHE_LOAD_CHUNK_MIB", str(CHUNK // MiB))
    monkeypatch.setenv(importset.ENV, str(_set_file(tmp_path / "set.json", libs)))
    drop_page_cache(files, everything=False)
    fd = os.open(files[0], os.O_RDONLY)
    was = resident_pages(fd, 0, files[0].stat().st_size)
    os.close(fd)
    if was is None or was[0] != 0 or not all(_resident(f) for f in libs):
        pytest.skip("this file system keeps no page cache the test can drop or hold")

    head = HeadStart(budget).judge()
    assert head.begin(files) == budget
    assert wait_until(lambda: "head_asked" in head.marks, 30)
    assert head.stats() == {"verdict": "asked", "budget_bytes": budget,
                            "asked_bytes": sum(want.values()), "files": len(want)}
    for path, end in want.items():  # the kernel read them (or is still reading them)
        assert wait_until(lambda p=path, e=end: _resident(p, 0, e), 30), path

    tp = HeadStart(budget, whole_files=False).judge()  # no look: nothing could come of it
    assert tp.begin(files) == 0 and tp.verdict == "tensor-parallel"
    late = HeadStart(budget)  # never judged: the spawn waits JUDGE_WAIT_S, then goes
    assert late.begin(files) == 0 and late.verdict == "late"

    drop_page_cache(libs, everything=False)
    cold = HeadStart(budget).judge()
    assert cold.begin(files) == 0
    assert cold.verdict == "set cold" and cold.stats()["asked_bytes"] == 0
    # Asked where the set is cold too, with the knob the load bench's `dropab` compares.
    drop_page_cache(files, everything=False)
    monkeypatch.setenv(loadenv.HEAD_START_COLD_ENV, "1")
    asked = HeadStart(budget).judge()
    assert asked.begin(files) == budget
    assert wait_until(lambda: "head_asked" in asked.marks, 30)
    assert asked.stats() == {"verdict": "asked, set cold", "budget_bytes": budget,
                             "asked_bytes": sum(want.values()), "files": len(want)}
    for path, end in want.items():
        assert wait_until(lambda p=path, e=end: _resident(p, 0, e), 30), path
