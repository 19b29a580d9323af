"""Reads made while a rank starts are used by the fill only when they are the fill's own bytes.

The fill takes a job from `EarlyReads` instead of the disk (bytes and digests) when the file it
opened is the very file the early reads read; the arena and the content record must then be
exactly what a fill without early reads gives, and a file changed after the early reads must be
read again (never the old bytes, never the old digests).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weightcache.native.engine.attach import query
from weightcache.native.shared import content
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.coldload import drop_page_cache, load_entries, plan_jobs, span_of
from weightcache.native.shared.content import FileIdentity
from weightcache.native.shared.diskshare import DiskShare
from weightcache.native.shared.earlyread import (
    BESIDE_ENV,
    BESIDE_JOBS_ENV,
    BUDGET_ENV,
    FOR_FILL_ENV,
    MAX_BUDGET,
    MAX_READ_JOBS,
    READ_JOBS,
    READ_JOBS_ENV,
    EarlyReads,
    _pieces,
    beside_jobs,
    cover_spans,
    default_budget,
    read_fully,
    read_jobs,
)
from weightcache.native.shared.loadenv import HEAD_START_ENV
from weightcache.native.shared.loader import plan_layout
from weightcache.native.shared.residency import resident_pages
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

from .conftest import wait_until

SHAPE = LlamaShape(hidden=256, layers=2, intermediate=768, vocab=1024, heads=4, kv_heads=2,
                   tied=False)
CHUNK = 1 << 20  # small reads: several jobs per file


@pytest.fixture(scope="module", params=[1, 3])
def model(request, tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("early") / "m", SHAPE,
                                  files=request.param)


def _fill(model: Path, early: EarlyReads | None):
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_entries(list(lay.entries), flat, threads=3, chunk=CHUNK, direct="auto",
                         digest=list(ckpt.files), early=early)
    return flat, stats


def _early(model: Path, budget: int) -> EarlyReads:
    # Buffered reads: the files were just written, and a resident range is left to the fill.
    early = EarlyReads(open_checkpoint(model).files, budget, chunk=CHUNK, threads=2,
                       direct=False).start()
    early.join()  # all of the budget read before the fill asks
    return early


def test_early_jobs_are_fill_jobs(model):
    """The early reads cut files exactly where the fill does: every early job is a fill job."""
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
    sizes = {f: f.stat().st_size for f in ckpt.files}
    fill = {(j.path, j.start, j.end) for j in plan_jobs(list(lay.entries), span_of(CHUNK), sizes)}
    early = EarlyReads(ckpt.files, 1 << 40, chunk=CHUNK)
    early._ready()  # never started: the jobs are cut on first use
    assert set(early._jobs) <= fill and len(early._jobs) == len(fill)
    assert cover_spans(0, 10) == [(0, 0)]
    assert cover_spans(25, 10) == [(0, 10), (10, 20), (20, 25)]
    early.close()


@pytest.mark.parametrize("budget", [1 << 40, 3 * CHUNK])
def test_the_fill_takes_early_jobs_and_gets_the_same_bytes_and_record(model, budget):
    want, plain = _fill(model, None)
    early = _early(model, budget)
    got, stats = _fill(model, early)
    assert stats.early_bytes == early.taken_bytes == early.read_bytes > 0
    if budget < 1 << 40:
        assert early.read_bytes <= budget < sum(f.stat().st_size
                                                for f in open_checkpoint(model).files)
    assert torch.equal(got, want)
    assert stats.record == plain.record == content.digest_files(open_checkpoint(model).files)
    early.close()


def test_a_file_rewritten_after_the_early_reads_is_read_again(tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    files = open_checkpoint(model).files
    early = _early(model, 1 << 40)
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # a weight's last byte: same size, same header, other content
    st = victim.stat()
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    got, stats = _fill(model, early)
    want, plain = _fill(model, None)
    assert torch.equal(got, want)  # the new bytes, not the early copy of the old ones
    assert stats.record == plain.record == content.digest_files(files)
    assert 0 < stats.early_bytes == files[0].stat().st_size < early.read_bytes
    early.close()


def test_a_file_truncated_after_the_early_reads_is_an_error(tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
    early = _early(model, 1 << 40)
    os.truncate(ckpt.files[0], ckpt.files[0].stat().st_size // 2)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    with pytest.raises(content.ContentError, match="truncated"):
        load_entries(list(lay.entries), flat, chunk=CHUNK, digest=list(ckpt.files), early=early)
    assert early.taken_bytes == 0
    early.close()


def test_the_budget_comes_from_the_environment_or_the_memory(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "64")
    assert default_budget(4) == 64 << 20
    monkeypatch.setenv(BUDGET_ENV, "0")
    assert default_budget() == 0
    for bad in ("-1", "lots"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=BUDGET_ENV):
            default_budget()
    monkeypatch.setenv(BUDGET_ENV, "auto")
    one, eight = default_budget(1), default_budget(8)
    assert 0 < eight <= one <= MAX_BUDGET == 16 << 30 and eight <= one // 4 + 1


def test_a_cpu_rank_reads_while_it_starts_and_serves_the_digest(tmp_path, sock_dir, preload):
    """Through the real launcher and rank: READY says what the early reads did, the fill took
    them, and the content the rank serves is the audit digest of the files."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=3)
    files = open_checkpoint(model).files
    drop_page_cache(files, everything=False)
    fd = os.open(files[0], os.O_RDONLY)
    cold = (resident_pages(fd, 0, files[0].stat().st_size) or (1, 1))[0] == 0
    os.close(fd)
    # The launcher's head start off: with the set in memory it would ask for this whole small
    # checkpoint, and the early reads leave what it asked to the fill (test_headstart.py).
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BUDGET_ENV: "auto", HEAD_START_ENV: "0"})
    ready = p.wait_ready(120)
    assert ready["head_start"]["verdict"] == "off"
    rank = ready["rank_loads"][0]
    early, loader = rank["early"], rank["loader"]
    assert early["budget_bytes"] >= early["read_bytes"] + early["resident_bytes"] > 0
    assert loader["early_bytes"] == early["taken_bytes"] == early["read_bytes"]
    if cold:  # the pages left: the rank read them while it started
        assert early["read_bytes"] > 0
        # ... from after it held its lock until before torch was imported, on READY's clock
        marks = rank["marks"]
        assert marks["locked"] <= early["first_read_at"] <= early["first_landed_at"]
        assert early["first_read_at"] < marks["imported"]
    digest = content.content_root(content.digest_files(open_checkpoint(model).files))
    assert query(ready["sockets"][0], "hello")["content"] == digest


def test_no_early_reads_with_a_zero_budget(tmp_path, sock_dir, preload):
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BUDGET_ENV: "0"})
    rank = p.wait_ready(120)["rank_loads"][0]
    assert rank["early"] is None and rank["loader"]["early_bytes"] == 0


def test_ranges_the_page_cache_holds_are_left_to_the_fill(tmp_path):
    """Copying a resident range early would only take CPU from the import beside it."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    files = open_checkpoint(model).files
    fd = os.open(files[0], os.O_RDONLY)
    known = resident_pages(fd, 0, 1)
    os.close(fd)
    if known is None:
        pytest.skip("this kernel answers neither cachestat nor mincore")
    drop_page_cache([files[0]], everything=False)
    for f in files[1:]:
        f.read_bytes()  # resident (unless memory pressure evicts it again: then it is read)
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=2).start()
    early.join()
    stats = early.stop()
    size0, rest = files[0].stat().st_size, sum(f.stat().st_size for f in files[1:])
    if stats["read_bytes"] == 0:
        pytest.skip("the file system keeps these pages (tmpfs?): nothing is cold here")
    # Every byte is either read early or left to the fill as resident; the cold file is read.
    assert stats["read_bytes"] + stats["resident_bytes"] == size0 + rest
    assert stats["read_bytes"] >= size0 and stats["resident_bytes"] > 0
    got, fill = _fill(model, early)
    assert fill.early_bytes == stats["read_bytes"]
    want, _ = _fill(model, None)
    assert torch.equal(got, want)
    early.close()


def test_the_fill_reads_at_the_idle_io_priority_when_asked(model, monkeypatch):
    from weightcache.native.shared.loadenv import IO_PRIORITY_ENV, io_priority

    assert io_priority(None) is False and io_priority("idle") is True
    with pytest.raises(ValueError, match=IO_PRIORITY_ENV):
        io_priority("high")
    monkeypatch.setenv(IO_PRIORITY_ENV, "idle")
    want, plain = _fill(model, None)  # same bytes and record at any priority
    monkeypatch.delenv(IO_PRIORITY_ENV)
    got, stats = _fill(model, None)
    assert torch.equal(got, want) and stats.record == plain.record


def test_a_checkpoint_of_many_files_keeps_descriptors_bounded(tmp_path, monkeypatch):
    """One file per tensor, more files than a reader keeps open: every byte still arrives."""
    from weightcache.native.shared import earlyread

    monkeypatch.setattr(earlyread, "MAX_OPEN_PER_THREAD", 4)
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=40)
    files = open_checkpoint(model).files
    assert len(files) > earlyread.MAX_OPEN_PER_THREAD
    drop_page_cache(files, everything=False)
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=1, direct=True).start()
    early.join()
    got, stats = _fill(model, early)
    want, plain = _fill(model, None)
    assert torch.equal(got, want) and stats.record == plain.record
    assert stats.early_bytes == early.read_bytes == sum(f.stat().st_size for f in files)
    early.close()


class _HeldDisk(DiskShare):
    """A disk whose first read waits until `go`: an early read still in flight when the fill
    starts. (The pacing is the stand-in here; the early reads and the fill are the real code.)"""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()

    def acquire(self, want: int) -> int:
        self.entered.set()
        self.go.wait(30)
        return want

    def release(self) -> None:
        pass


def test_a_read_in_flight_when_the_fill_starts_is_taken_once_it_lands(model):
    """The fill starts without waiting for the early reads in flight (a drain leaves the
    disk's queue short while the fill sets up), and takes such a job once it has landed
    instead of reading it again: the same bytes and record as a fill without early reads."""
    files = open_checkpoint(model).files
    disk = _HeldDisk()
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=1, direct=True, disk=disk).start()
    assert disk.entered.wait(10)  # the one early reader's first job is at the disk
    out: list = []
    filler = threading.Thread(target=lambda: out.append(_fill(model, early)))
    filler.start()
    # The fill accepted the early reads: it did not wait for the read.
    accepted = wait_until(lambda: early.stats()["seconds"] > 0, 10)
    time.sleep(0.2)
    assert not out  # the fill waits for the job in flight rather than finishing without it
    disk.go.set()
    filler.join(30)
    assert accepted and out
    got, stats = out[0]
    want, plain = _fill(model, None)
    first = cover_spans(files[0].stat().st_size, early.span)[0]
    assert stats.early_bytes == early.taken_bytes == early.read_bytes >= first[1] - first[0]
    # No byte read twice: what the early reads did not read, the fill read from the disk.
    assert early.read_bytes + stats.read_bytes == sum(f.stat().st_size for f in files)
    assert torch.equal(got, want) and stats.record == plain.record
    early.close()


def test_the_early_reads_go_on_beside_the_fill_and_each_job_is_read_once(tmp_path, monkeypatch):
    """Once the fill began (`accept`), the early reads keep reading the jobs that nobody has
    begun, and a job the fill asked for first is the fill's: never read by both. (Stopping the
    early reads when the fill began left the disk's queue short while the fill set up.)"""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    files = open_checkpoint(model).files
    drop_page_cache(files, everything=False)
    go = threading.Event()
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=2, direct=False).start(go, 60)
    early.accept({p: early.identities[p] for p in files})  # the fill began before any read
    first, second = cover_spans(files[0].stat().st_size, early.span)[:2]
    assert early.take(files[0], *first) is None  # not begun: the fill's own job from now on
    go.set()
    early.join()
    total = sum(f.stat().st_size for f in files)
    stats = early.stats()
    assert stats["read_bytes"] == stats["after_accept_bytes"] == total - (first[1] - first[0])
    assert stats["claimed_bytes"] == first[1] - first[0]
    assert early.take(files[0], *first) is None  # still the fill's
    data = early.take(files[0], *second)
    assert data is not None
    assert bytes(data) == files[0].read_bytes()[second[0] : second[1]]
    del data
    # A file the fill did not open as the same file is read no further.
    late = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=2, direct=False)
    late.accept({files[0]: late.identities[files[0]]})
    late.start().join()
    assert late.read_bytes == files[0].stat().st_size
    assert late.take(files[1], 0, min(files[1].stat().st_size, late.span)) is None
    # The earlier way, kept to compare: nothing more is read once the fill began.
    monkeypatch.setenv(BESIDE_ENV, "0")
    stopped = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=2, direct=False)
    stopped.accept({p: stopped.identities[p] for p in files})
    stopped.start().join()
    assert stopped.read_bytes == 0 and stopped.stats()["beside_fill"] is False
    for e in (early, late, stopped):
        e.close()


def test_the_files_are_opened_beside_the_reads_not_before_them(tmp_path):
    """Neither `EarlyReads(...)` nor `start` opens a file: the rank's main thread goes on to
    its `import torch` at once (291 opens took 36-96 ms there on H100 VMs, runs 54 and 56).
    One of the pool's threads opens the files in name order, and each file is read as soon
    as it is open, not after the last one. The fill never waits for the opener: `accept`
    ends the opening, and a file opened after it is closed, not read. A FIFO last in name
    order makes the opener's last open block until a writer comes."""
    files = []
    for i, size in enumerate((3 * CHUNK + 5, CHUNK // 3)):
        files.append(tmp_path / f"f{i}.bin")
        files[-1].write_bytes(os.urandom(size))
    fifo = tmp_path / "z-pipe"
    os.mkfifo(fifo)
    made: list[EarlyReads] = []
    starter = threading.Thread(target=lambda: made.append(EarlyReads(
        [fifo, *files], 1 << 40, chunk=CHUNK, threads=2, direct=False).start()), daemon=True)
    starter.start()
    starter.join(30)
    early = made[0] if made else None
    try:
        assert early is not None, "EarlyReads(...).start() waited for a blocked open"
        total = sum(f.stat().st_size for f in files)
        assert wait_until(lambda: early.read_bytes == total, 30), early.stats()
        assert not early._opened.is_set()  # the pipe's open still blocks: read all the same
        idents = {f: FileIdentity.of(f.stat()) for f in files}
        accepter = threading.Thread(target=early.accept, args=(idents,), daemon=True)
        accepter.start()
        accepter.join(30)
        assert not accepter.is_alive(), "accept() waited for the opener"
    finally:
        os.close(os.open(fifo, os.O_WRONLY))  # the opener's open returns
    assert early._opened.wait(30)
    assert set(early.identities) == set(files)  # the pipe, opened after accept, is closed
    for path in files:
        for start, end in cover_spans(path.stat().st_size, early.span):
            got = early.take(path, start, end)
            assert got is not None and bytes(got) == path.read_bytes()[start:end]
            del got
    early.close()


def test_readers_waiting_for_the_import_set_stop_at_once(tmp_path):
    """Readers held until the import set is read (`after`, at most `wait_s`) end as soon as
    they are stopped: a rank stopped while its set is still read exits then, not `wait_s`
    later (`stop` waits for every reader)."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    files = open_checkpoint(model).files
    never = threading.Event()
    early = EarlyReads(files, 1 << 40, chunk=CHUNK, threads=4, direct=False).start(never, 600)
    assert wait_until(lambda: early._pool is not None and early._pool.working == 4)
    stopper = threading.Thread(target=early.close)
    stopper.start()
    stopper.join(30)  # far below the 600 s the readers would otherwise wait
    assert not stopper.is_alive(), "the stopped readers still waited for the import set"
    assert early.read_bytes == 0 and early._pool.working == 0


class _FirstReadHeld(EarlyReads):
    """Early reads whose first job waits until `go`: a reader busy at the disk when the fill
    reaches a job no read began. (The wait is the stand-in; claiming, asking and reading are
    the real code.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.go = threading.Event(), threading.Event()
        self.order: list[tuple[Path, int]] = []
        self.read_jobs = 1  # the held read is the first job alone (`_follow`)

    def _read(self, jobs, direct_fds):
        self.order.extend((job.path, job.start) for job in jobs)
        if len(self.order) == 1:
            self.entered.set()
            self.go.wait(30)
        return super()._read(jobs, direct_fds)


def _skip_without_direct(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("the file system refuses O_DIRECT")


def _held_reader(tmp_path, direct: bool = True
                 ) -> tuple[_FirstReadHeld, list[Path], list[tuple[int, int]]]:
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    files = open_checkpoint(model).files
    drop_page_cache(files, everything=False)
    if direct:
        _skip_without_direct(files[0])
    early = _FirstReadHeld(files, 1 << 40, chunk=CHUNK, threads=1, direct=direct).start()
    assert early.entered.wait(10)  # the one reader is at its first job
    early.accept({p: early.identities[p] for p in files})  # the fill began
    spans = cover_spans(files[0].stat().st_size, early.span)
    assert len(spans) >= 3
    return early, files, spans


def _take_in_thread(early: EarlyReads, path: Path, span: tuple[int, int]):
    out: list = []
    taker = threading.Thread(target=lambda: out.append(early.take(path, *span)))
    taker.start()
    return taker, out


def test_a_job_the_fill_reaches_first_is_read_for_it_next_by_an_early_reader(tmp_path,
                                                                             monkeypatch):
    """With `WEIGHTCACHE_EARLY_READS_FOR_FILL=1`, the fill reaches a job no early read began
    while the early readers read: one of them reads it next, ahead of its own order, and the
    fill waits for it, so the disk keeps one set of readers. Every job is still read once,
    and the bytes are the file's."""
    monkeypatch.setenv(FOR_FILL_ENV, "1")
    early, files, spans = _held_reader(tmp_path)
    third = spans[2]
    taker, out = _take_in_thread(early, files[0], third)
    assert wait_until(lambda: early.stats()["asked_bytes"] == third[1] - third[0], 10)
    time.sleep(0.1)
    assert not out  # waiting for the early reader, not reading it itself
    early.go.set()
    taker.join(30)
    assert out and out[0] is not None
    assert bytes(out[0]) == files[0].read_bytes()[third[0] : third[1]]
    del out[0]
    # Read right after the job in flight, before the job the reader's order had next.
    assert early.order[:3] == [(files[0], spans[0][0]), (files[0], third[0]),
                               (files[0], spans[1][0])]
    early.join()
    stats = early.stats()
    assert stats["claimed_bytes"] == 0 and stats["for_fill"] is True
    assert stats["read_bytes"] == sum(f.stat().st_size for f in files)  # each job once
    assert len(early.order) == len(set(early.order))
    early.close()


@pytest.mark.parametrize("why", ["default", "no O_DIRECT"])
def test_the_fill_reads_a_job_no_read_began_itself(tmp_path, monkeypatch, why):
    """By default (`WEIGHTCACHE_EARLY_READS_FOR_FILL` unset: measured no slower), and where the
    early reads are buffered even when it is 1 (a file system that refuses O_DIRECT: a few
    readers, not the fill's 32), such a job is the fill's at once, even while an early reader
    reads, and no early read begins it."""
    if why == "no O_DIRECT":
        monkeypatch.setenv(FOR_FILL_ENV, "1")
    early, files, spans = _held_reader(tmp_path, direct=why != "no O_DIRECT")
    third = spans[2]
    assert early.take(files[0], *third) is None  # at once: the caller reads it
    early.go.set()
    early.join()
    stats = early.stats()
    assert stats["claimed_bytes"] == third[1] - third[0] and stats["asked_bytes"] == 0
    assert stats["for_fill"] is (why != "default")
    assert (files[0], third[0]) not in early.order
    assert stats["read_bytes"] == sum(f.stat().st_size for f in files) - (third[1] - third[0])
    early.close()


def test_a_job_asked_for_when_the_early_reads_stop_is_the_fills(tmp_path, monkeypatch):
    """Early reads stopped (the rank stops, or every reader ended) while the fill waits for a
    job it asked for: the job goes back to the fill, which reads it; nothing waits forever."""
    monkeypatch.setenv(FOR_FILL_ENV, "1")
    early, files, spans = _held_reader(tmp_path)
    third = spans[2]
    taker, out = _take_in_thread(early, files[0], third)
    assert wait_until(lambda: early.stats()["asked_bytes"] > 0, 10)
    stopper = threading.Thread(target=early.stop)
    stopper.start()
    assert wait_until(early._stop.is_set, 10)
    early.go.set()  # the read in flight lands; no reader begins another
    stopper.join(30)
    taker.join(30)
    assert not taker.is_alive() and out == [None]
    stats = early.stats()
    assert stats["claimed_bytes"] == third[1] - third[0] and stats["asked_bytes"] == 0
    assert (files[0], third[0]) not in early.order
    early.close()


class _Calls(EarlyReads):
    """Early reads that note the jobs of each read call (the reading is the real code's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[tuple[Path, int, int]]] = []

    def _read(self, jobs, direct_fds):
        self.calls.append([(job.path, job.start, job.end) for job in jobs])
        return super()._read(jobs, direct_fds)


def _direct_files(tmp_path: Path, sizes: tuple[int, ...] = (11 * CHUNK // 2, 3 * CHUNK + 123)
                  ) -> list[Path]:
    """Files of random bytes, out of the page cache, where O_DIRECT works (else a skip)."""
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}.bin"
        with open(path, "wb") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())
        paths.append(path)
    drop_page_cache(paths, everything=False)
    _skip_without_direct(paths[0])
    return paths


def test_the_read_jobs_knob_is_lenient_and_bounded(monkeypatch):
    """A bad value is the default (a speed knob never fails a start); a huge one is bounded,
    so one call's pieces stay below the kernel's limit on them."""
    for value, want in (("", READ_JOBS), ("junk", READ_JOBS), ("0", READ_JOBS), ("-3", READ_JOBS),
                        ("1", 1), ("8", 8), ("100000", MAX_READ_JOBS)):
        monkeypatch.setenv(READ_JOBS_ENV, value)
        assert read_jobs() == want, value


@pytest.mark.parametrize("knob", [None, "1", "junk"])
def test_while_the_rank_starts_a_reader_reads_consecutive_jobs_with_one_call(
        tmp_path, monkeypatch, knob):
    """While the rank starts (before `accept`), one O_DIRECT read call covers READ_JOBS
    consecutive jobs of one file (32 x 64 MiB in flight, a cushion against the GIL that
    `import torch` holds), never two files' and never past a file's last job; each job's
    bytes land in its own place, so the fill takes exactly the file's bytes. With
    `WEIGHTCACHE_EARLY_READ_JOBS=1` a call reads one job; a bad value is the default."""
    if knob is not None:
        monkeypatch.setenv(READ_JOBS_ENV, knob)
    files = _direct_files(tmp_path)
    early = _Calls(files, 1 << 40, chunk=CHUNK, threads=2, direct=True).start()
    early.join()
    want = 1 if knob == "1" else READ_JOBS
    assert early.read_jobs == want
    jobs = sorted(early._jobs)
    assert sorted(j for call in early.calls for j in call) == jobs  # each job in one call
    for call in early.calls:
        assert len({path for path, _, _ in call}) == 1  # one file
        assert all(a[2] == b[1] for a, b in itertools.pairwise(call))  # consecutive
    # 6 jobs (the last half a chunk) and 4 (the last 123 bytes): whole groups, a file's end
    # ends one.
    sizes = {path: sorted(len(c) for c in early.calls if c[0][0] == path) for path in files}
    assert sizes == ({files[0]: [2, 4], files[1]: [4]} if want == 4
                     else {files[0]: [1] * 6, files[1]: [1] * 4})
    stats = early.stats()
    assert stats["read_bytes"] == stats["direct_bytes"] == sum(f.stat().st_size for f in files)
    early.accept({p: early.identities[p] for p in files})
    for path, start, end in jobs:
        got = early.take(path, start, end)
        assert got is not None and bytes(got) == path.read_bytes()[start:end]
        del got
    early.close()


def test_after_the_fill_began_and_while_gentle_a_reader_reads_one_job_per_call(tmp_path):
    """Beside the fill (after `accept`) the fill waits for the jobs it takes, and a gentle
    share allows small pieces only: one job per call then."""
    files = _direct_files(tmp_path)[:1]
    early = _Calls(files, 1 << 40, chunk=CHUNK, threads=1, direct=True)
    early.accept({p: early.identities[p] for p in files})
    early.start().join()
    assert early.calls and all(len(call) == 1 for call in early.calls)
    early.close()
    calls, stats = _read_while_gentle(files, accepted=False)
    assert calls and all(len(call) == 1 for call in calls)
    assert stats["read_bytes"] == files[0].stat().st_size


def _read_while_gentle(files: list[Path], accepted: bool
                       ) -> tuple[list[list[tuple[Path, int, int]]], dict]:
    """One early reader's calls and stats over `files` (out of the page cache again) while its
    disk share is gentle, after `accept` or before it (a skip where /proc/vmstat is
    unreadable)."""
    drop_page_cache(files, everything=False)
    share = DiskShare(start_gentle=60.0, source="/proc/vmstat")
    if not share.available:
        pytest.skip("/proc/vmstat is unreadable here")
    share.start()
    try:
        assert share.gentle
        early = _Calls(files, 1 << 40, chunk=CHUNK, threads=1, direct=True, disk=share)
        if accepted:
            early.accept({p: early.identities[p] for p in files})
        early.start().join()
        stats = early.stats()
        early.close()
        return early.calls, stats
    finally:
        share.stop()


def test_the_beside_jobs_knob_is_lenient_and_bounded(monkeypatch):
    """Jobs per call beside the fill: one by default, a bad value is the default, a huge one
    bounded like the start's."""
    for value, want in (("", 1), ("junk", 1), ("0", 1), ("4", 4), ("100000", MAX_READ_JOBS)):
        monkeypatch.setenv(BESIDE_JOBS_ENV, value)
        assert beside_jobs() == want, value


def test_with_the_beside_jobs_knob_a_reader_groups_its_jobs_beside_the_fill_too(
        tmp_path, monkeypatch):
    """`WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL=4`: after `accept` a call covers up to 4
    consecutive jobs of one file (never two files', a file's end ends one) and the fill takes
    each job's own bytes; while gentle, still one job per call."""
    monkeypatch.setenv(BESIDE_JOBS_ENV, "4")
    files = _direct_files(tmp_path)
    early = _Calls(files, 1 << 40, chunk=CHUNK, threads=1, direct=True)
    early.accept({p: early.identities[p] for p in files})
    early.start().join()
    assert early.stats()["beside_jobs"] == 4
    sizes = {path: sorted(len(c) for c in early.calls if c[0][0] == path) for path in files}
    assert sizes == {files[0]: [2, 4], files[1]: [4]}
    for call in early.calls:
        assert all(a[2] == b[1] and a[0] == b[0] for a, b in itertools.pairwise(call))
    for path, start, end in sorted(early._jobs):
        got = early.take(path, start, end)
        assert got is not None and bytes(got) == path.read_bytes()[start:end]
        del got
    early.close()
    calls, _ = _read_while_gentle(files[:1], accepted=True)
    assert calls and all(len(call) == 1 for call in calls)


def test_a_file_shorter_than_its_jobs_keeps_only_the_jobs_read_whole(tmp_path):
    """A file cut short after the jobs were planned: a grouped read gets fewer bytes, the jobs
    it read whole are kept, the rest dropped (the fill reads them, and says the file
    changed)."""
    files = _direct_files(tmp_path)[:1]
    early = _Calls(files, 1 << 40, chunk=CHUNK, threads=1, direct=True)
    early._ready()  # the jobs cut now, before the file is cut short
    spans = sorted((s, e) for _, s, e in early._jobs)
    assert len(spans) >= READ_JOBS
    cut = spans[1][1] + 4096  # two jobs whole, the third begun
    with open(files[0], "r+b") as fh:
        fh.truncate(cut)
    early.start().join()
    assert len(early.calls[0]) == READ_JOBS
    states = [early._jobs[(files[0], s, e)].state for s, e in spans]
    assert states[:2] == [2, 2] and all(state == 3 for state in states[2:])
    assert early.stats()["read_bytes"] == spans[1][1]
    early.close()


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.data())
def test_pieces_are_the_views_bytes_in_order(sizes, data):
    """`_pieces` (the iovecs of one read call) are the bytes [start, start + count) of the
    views taken as one run."""
    buffers = [bytearray(os.urandom(n)) for n in sizes]
    whole = b"".join(buffers)
    start = data.draw(st.integers(0, len(whole)))
    count = data.draw(st.integers(0, len(whole) - start))
    pieces = _pieces([memoryview(b) for b in buffers], start, count)
    assert b"".join(bytes(p) for p in pieces) == whole[start : start + count]
    assert all(len(p) for p in pieces)


def test_read_fully_fills_several_views_from_one_run_of_the_file(tmp_path):
    """One run of the file into several views, one after another; fewer bytes only at the
    end of the file."""
    path = tmp_path / "f"
    data = os.urandom(10000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        views = [memoryview(bytearray(n)) for n in (3000, 4000, 5000)]
        got = read_fully(fd, views, 500)
        assert got == 9500
        assert b"".join(bytes(v) for v in views)[:9500] == data[500:]
    finally:
        os.close(fd)
