"""A load yields the disk while other programs fault pages in, and loads the same bytes.

The faults here are real: a file written to the disk, dropped from the page cache, mapped with
readahead off and touched page by page, so the kernel's own `pgmajfault` counter moves, as it
does while an engine imports its libraries beside a loading daemon.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import threading
import time
from collections import deque
from pathlib import Path

import pytest
import torch

from weightcache.native.shared import diskshare, loadenv
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.coldload import drop_page_cache, load_entries
from weightcache.native.shared.diskshare import DiskShare, read_faults
from weightcache.native.shared.loader import plan_layout, tensors_from_table
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

from .conftest import wait_until

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def _fault(path: Path, pages: int) -> int:
    """Major faults made by touching `pages` pages of the cold file at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_RANDOM)  # no readahead: one fault per touched page
            before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            step = max(PAGE, size // pages - (size // pages) % PAGE)
            total = 0
            for at in range(0, size, step):
                total += m[at]
            assert total >= 0
            return resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path) -> Path:
    path = tmp_path / "cold.bin"
    with open(path, "wb") as fh:
        fh.write(os.urandom(32 * MiB))
        fh.flush()
        os.fsync(fh.fileno())
    if _fault(path, 8) == 0:
        pytest.skip("this file system serves mapped pages without major faults (tmpfs?)")
    return path


def test_the_fault_counter_is_the_kernels():
    first = read_faults()
    assert isinstance(first, int) and first >= 0
    assert read_faults("/nonexistent/vmstat") is None


def test_env_values():
    assert loadenv.yield_mode(None) and loadenv.yield_mode("") and loadenv.yield_mode("auto")
    assert not loadenv.yield_mode("off") and not loadenv.yield_mode("0")
    with pytest.raises(ValueError, match="WEIGHTCACHE_LOAD_YIELD"):
        loadenv.yield_mode("sometimes")


def test_faults_make_reads_gentle_and_quiet_makes_them_full(cold_file):
    share = DiskShare(interval=0.01, window=0.3, faults=4, hold=0.3).start()
    try:
        assert share.available
        # Nobody faulting (a shared machine may fault now and then: wait for a quiet spell).
        assert wait_until(lambda: not share.gentle, 10)
        got = share.acquire(16 * MiB)
        share.release()
        assert got == 16 * MiB
        stop = threading.Event()

        def faulter() -> None:
            while not stop.is_set():
                _fault(cold_file, 64)

        t = threading.Thread(target=faulter)
        t.start()
        try:
            assert wait_until(lambda: share.gentle, 5), "64 major faults at a time went unseen"
            got = share.acquire(16 * MiB)
            share.release()
            assert got == diskshare.GENTLE_READ
            # At most GENTLE_READERS reads at a time while gentle.
            inside, most = [0], [0]
            lock = threading.Lock()

            def reader() -> None:
                for _ in range(20):
                    share.acquire(MiB)
                    with lock:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.002)
                    with lock:
                        inside[0] -= 1
                    share.release()

            readers = [threading.Thread(target=reader) for _ in range(8)]
            for r in readers:
                r.start()
            for r in readers:
                r.join()
            if share.gentle:
                assert most[0] <= diskshare.GENTLE_READERS
        finally:
            stop.set()
            t.join()
        assert wait_until(lambda: not share.gentle, 10), "still gentle long after the faults ended"
        stats = share.stats()
        assert stats["gentle_switches"] >= 1 and stats["gentle_seconds"] > 0
        assert stats["most_faults_in_window"] >= 4
    finally:
        share.stop()
    assert share.acquire(16 * MiB) == 16 * MiB  # stopped: full
    share.release()


SHAPE = LlamaShape(hidden=256, layers=2, intermediate=768, vocab=1024, heads=4, kv_heads=2,
                   tied=False)


def test_a_gentle_load_reads_the_same_bytes(tmp_path):
    """Gentle the whole time (a threshold of zero faults): 1 MiB direct reads, two at a time,
    give exactly the bytes and the record of a full-speed load."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)

    def fill(share: DiskShare | None):
        drop_page_cache(ckpt.files, everything=False)
        flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
        stats = load_entries(list(lay.entries), flat, threads=4, chunk=4 * MiB, direct=True,
                             digest=list(ckpt.files), disk=share)
        return flat, stats

    gentle = DiskShare(interval=0.01, faults=0).start()
    assert wait_until(lambda: gentle.gentle, 5)
    try:
        flat_g, stats_g = fill(gentle)
    finally:
        gentle.stop()
    off = DiskShare(source="/nonexistent")  # unreadable counter: never gentle
    flat_f, stats_f = fill(off)
    assert torch.equal(flat_g, flat_f)
    assert stats_g.record == stats_f.record
    assert stats_g.disk["gentle_seconds"] > 0 and stats_f.disk["gentle_seconds"] == 0
    if stats_g.direct_bytes == 0:
        pytest.skip("this file system refuses O_DIRECT: the reads were never gated")
    ref = tensors_from_table(flat_f, lay.table(), lay.aliases)
    from safetensors.torch import load_file

    for f in ckpt.files:
        for name, tensor in load_file(str(f)).items():
            assert torch.equal(ref[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_share_that_starts_gentle_goes_full_without_faults():
    """A rank's early reads start gentle (its import may fault at once) and go full once no
    program faulted for a while (the libraries were in the page cache)."""
    share = DiskShare(interval=0.01, window=0.1, hold=0.2, start_gentle=0.3).start()
    try:
        assert share.gentle
        assert share.acquire(16 * MiB) == diskshare.GENTLE_READ
        share.release()
        assert wait_until(lambda: not share.gentle, 10)
    finally:
        share.stop()


BAD_KNOBS = {
    loadenv.THREADS_ENV: "many",
    loadenv.CHUNK_ENV: "0",
    loadenv.DIRECT_ENV: "sometimes",
    loadenv.IO_PRIORITY_ENV: "high",
    loadenv.YIELD_ENV: "sometimes",
    loadenv.HOT_STEP_ENV: "1024",
}


@pytest.mark.parametrize("name", sorted(BAD_KNOBS))
def test_a_bad_knob_never_fails_a_load_from_disk(name, tmp_path, monkeypatch):
    """An engine's disk fallback goes through the same loader: a knob that only tunes reads
    must not turn a load that would succeed into a crash. The check a rank runs names it."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
    want = torch.zeros(lay.nbytes, dtype=torch.uint8)
    load_entries(list(lay.entries), want, digest=list(ckpt.files))
    monkeypatch.setenv(name, BAD_KNOBS[name])
    with pytest.raises(ValueError, match=name):
        loadenv.check()
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_entries(list(lay.entries), flat, digest=list(ckpt.files))  # the defaults
    assert torch.equal(flat, want) and stats.nbytes == lay.nbytes


def test_ready_reports_the_share(tmp_path, sock_dir, preload):
    """READY carries the share's stats; a node's first start (no import set yet) starts gentle
    for START_GENTLE, and a start that finds the import set the first one wrote starts with no
    gentle span (its census or read settles the share: rank.start_early_reads)."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    set_file = tmp_path / "import-set.json"  # this test's own node: no set yet
    env = {**os.environ, "WEIGHTCACHE_IMPORT_SET": str(set_file)}
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir), env=env)
    disk = p.wait_ready(120)["rank_loads"][0]["loader"]["disk"]
    assert disk["available"] is True
    assert set(disk) == {"available", "gentle_switches", "gentle_seconds",
                         "most_faults_in_window", "faults", "own_faults", "counts_own",
                         "fault_times", "settled_at", "start_gentle", "hold", "hold_max",
                         "longest_hold", "reads_seen", "read_events", "others_read_bytes"}
    assert disk["reads_seen"] is True and disk["others_read_bytes"] >= 0
    assert disk["hold"] == diskshare.HOLD and disk["hold_max"] == diskshare.HOLD_MAX
    assert 0 <= disk["longest_hold"] <= diskshare.HOLD_MAX
    assert disk["start_gentle"] == diskshare.START_GENTLE > 0
    assert disk["counts_own"] is False  # its device was open: the rank's start was over
    assert 0 <= disk["own_faults"] <= disk["faults"]
    # The first start's gentle span: at least that switch, and its time, are counted.
    assert disk["gentle_switches"] >= 1 and disk["gentle_seconds"] > 0
    assert wait_until(set_file.exists, 30), "the first start wrote no import set"
    assert p.stop() == 0
    again = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir), env=env)
    disk = again.wait_ready(120)["rank_loads"][0]["loader"]["disk"]
    assert disk["start_gentle"] == 0.0


# Where shares on made-up counters look for processes: nowhere. With the real /proc, a sample
# that caught the system's count before the made-up own one would look for the faulting
# process there and adopt this worker's real children (other tests' daemons), adding their
# real faults to the made-up counts.
NO_PROC = "/nonexistent/proc"


def _counters(tmp_path: Path, system: int, own: int) -> tuple[str, str]:
    """A vmstat and a proc_pid_stat(5) line with these counts (the command name holds
    spaces and parentheses, as a real one may)."""
    vmstat, stat = tmp_path / "vmstat", tmp_path / "stat"
    tmp = tmp_path / "tmp"
    tmp.write_text(f"pgfault 1\npgmajfault {system}\npswpin 0\n")
    os.replace(tmp, vmstat)  # whole lines only: the sampler never sees half a file
    tmp.write_text(f"4242 (python (x) y) S 1 2 3 4 5 6 7 8 {own} 0 0 0 0\n")
    os.replace(tmp, stat)
    return str(vmstat), str(stat)


def test_this_process_fault_counter_is_its_own(cold_file):
    before = diskshare.read_own_faults()
    assert isinstance(before, int) and before >= 0
    made = _fault(cold_file, 32)
    assert made > 0
    after = diskshare.read_own_faults()
    assert after - before >= made
    assert diskshare.read_own_faults("/nonexistent/stat") is None


def test_the_own_counter_is_read_past_a_command_name_with_parentheses(tmp_path):
    _, stat = _counters(tmp_path, 0, 42)
    assert diskshare.read_own_faults(stat) == 42


def test_a_loads_own_faults_never_make_it_gentle_and_others_still_do(tmp_path):
    """A running program's load (own=False) subtracts its own faults: CUDA faulting kernel
    code in on a reader's first copy is not a program starting beside it. Faults of others
    still make it gentle, and a rank's share counts its own until `ignore_own`."""
    vmstat, stat = _counters(tmp_path, 1000, 500)
    # 10 per window: the two files are read one after the other, so a sample may catch one
    # step (5) of ours in the system's count and not yet in our own.
    quiet = DiskShare(interval=0.01, window=0.2, faults=10, hold=0.2, source=vmstat,
                      own=False, own_source=stat, proc=NO_PROC).start()
    starting = DiskShare(interval=0.01, window=0.2, faults=10, hold=0.2, source=vmstat,
                         own=True, own_source=stat, proc=NO_PROC).start()
    assert quiet.watching.wait(30) and starting.watching.wait(30)  # their baselines: 1000, 500
    try:
        system, own = 1000, 500
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # only our own faults, 5 every 10 ms
            system, own = system + 5, own + 5
            _counters(tmp_path, system, own)
            time.sleep(0.01)
            assert not quiet.gentle, "its own faults made a running load gentle"
        assert starting.gentle, "a starting rank's own faults went unseen"
        starting.ignore_own()
        assert wait_until(lambda: not starting.gentle, 2), "ignore_own did not take"
        system += 20  # another program faults
        _counters(tmp_path, system, own)
        assert wait_until(lambda: quiet.gentle and starting.gentle, 2), "others' faults went unseen"
    finally:
        stats = quiet.stop()
        starting.stop()
    assert stats["own_faults"] == own - 500 and stats["faults"] == system - 1000
    assert stats["counts_own"] is False
    times = stats["fault_times"]  # [seconds, others', own, kin's] per sample that saw any
    assert 0 < len(times) <= diskshare.TIMELINE
    assert all(t[0] >= 0 and t[1] + t[2] > 0 for t in times)
    assert sum(t[1] for t in times) >= 20 or len(times) == diskshare.TIMELINE


def test_settle_forgets_the_faults_before_it_and_a_later_fault_counts_again(tmp_path):
    """A rank whose import set was read whole settles its share: the faults seen before are
    forgotten at once (those pages are in memory now), while a fault after it makes the
    reads gentle again."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    share = DiskShare(interval=0.01, window=0.2, hold=5.0, source=vmstat,
                      own_source=stat, proc=NO_PROC).start()
    try:
        # On a loaded machine the thread may first run after the next write: wait for its
        # baseline (1000 faults).
        assert share.watching.wait(30), "the sampler never read the counters"
        _counters(tmp_path, 1010, 0)  # faults beside the set: gentle for at least `hold`
        assert wait_until(lambda: share.stats()["faults"] == 10, 2)
        assert share.gentle and share.stats()["settled_at"] is None
        share.settle()
        assert not share.gentle, "settle() must take at once, not after the hold"
        assert share.acquire(16 * MiB) == 16 * MiB
        share.release()
        time.sleep(0.3)  # well past a sample or two: the old faults stay forgotten
        assert not share.gentle
        assert share.stats()["settled_at"] is not None
        _counters(tmp_path, 1011, 0)  # a program faults after it
        assert wait_until(lambda: share.gentle, 2), "a fault after settle() went unseen"
    finally:
        stats = share.stop()
    assert stats["faults"] == 11 and 0 <= stats["settled_at"] < 5


def test_a_settle_keeps_the_starts_gentle_span_and_forgets_the_faults(tmp_path):
    """A rank settles its share at its first moment (its import set found in memory): the
    start's gentle span runs its course (`import torch` beside full reads from its first
    moment was 1 s slower), the faults seen before the settle are forgotten, so the reads go
    full when the span ends, not a hold after those faults."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    share = DiskShare(interval=0.01, window=0.2, hold=30.0, start_gentle=0.4, source=vmstat,
                      own_source=stat, proc=NO_PROC).start()
    try:
        assert share.watching.wait(30), "the sampler never read the counters"
        _counters(tmp_path, 1010, 0)  # faults before the settle: gentle for `hold`
        assert wait_until(lambda: share.stats()["faults"] == 10, 2)
        share.settle()
        assert share.gentle, "the start's span ended with the settle"
        assert wait_until(lambda: not share.gentle, 5), "the forgotten faults kept it gentle"
        assert share.stats()["settled_at"] < 0.4
    finally:
        stats = share.stop()
    assert 0.3 <= stats["gentle_seconds"] < 5


def test_a_settle_while_the_sampler_looks_is_not_undone_by_that_look(tmp_path):
    """A settle comes while the sampler is in the middle of a look that saw faults (the settle
    forgets them): that look's verdict is older than the settle and must not be applied. On
    an H100 VM it was, and it stood until the next look, which the rank's `import torch`
    held off with the GIL. Here the look is held at the counters' read (a FIFO) until the
    settle is done."""
    fifo = tmp_path / "vmstat.fifo"
    os.mkfifo(fifo)
    _, stat = _counters(tmp_path, 1000, 0)

    def feed(count: int = 1000) -> None:  # one read: open blocks until the reader opens
        with open(fifo, "w") as fh:
            fh.write(f"pgmajfault {count}\npswpin 0\n")

    # One feed per read, each after the last read closed the FIFO: a writer that opened it
    # while an earlier read still held it would write into that read instead.
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()  # the share's check at construction
    share = DiskShare(interval=0.01, window=5.0, hold=30.0, source=str(fifo), own_source=stat,
                      proc=NO_PROC)
    feeder.join(10)
    assert share.available
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()  # the sampler's first look
    share.start()
    try:
        assert share.watching.wait(10), "the sampler never read the counters"
        feeder.join(10)
        assert not share.gentle
        with open(fifo, "w") as fh:  # returns once the next look opened it: it has begun
            share.settle()
            fh.write("pgmajfault 1010\npswpin 0\n")  # the faults this look sees
        # Its next look waits at the FIFO: whatever this look decided stays until then.
        assert not wait_until(lambda: share.gentle, 0.5), \
            "a look begun before settle() made the share gentle after it"
    finally:
        unblock = threading.Thread(target=lambda: [feed(1010) for _ in range(3)], daemon=True)
        unblock.start()
        share.stop()
        with contextlib.suppress(OSError):  # a feed left waiting for a reader
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert share.stats()["gentle_seconds"] < 0.2


def test_a_held_share_stays_gentle_without_faults_until_settled_or_let_go(tmp_path):
    """Early reads beside the read of the import set (which faults nothing) stay gentle while
    it runs, however long; `let_go` hands the choice back to the faults (none: full once the
    start's span is over), `settle` ends it at once."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    share = DiskShare(interval=0.01, window=0.1, hold=0.1, start_gentle=0.05, source=vmstat,
                      own_source=stat, proc=NO_PROC).start()
    try:
        share.hold_gentle()
        time.sleep(0.5)  # many samples, no fault, the start's span long over
        assert share.gentle, "a held share went full without a fault"
        assert share.acquire(16 * MiB) == diskshare.GENTLE_READ
        share.release()
        share.let_go()
        assert wait_until(lambda: not share.gentle, 5), "let_go() left it gentle with no faults"
        assert share.stats()["settled_at"] is None
        share.hold_gentle()
        assert share.gentle
        share.settle()
        assert not share.gentle, "settle() must end the hold at once"
        time.sleep(0.2)
        assert not share.gentle  # the hold stays ended
    finally:
        share.stop()


def test_a_ranks_launcher_faults_as_its_own_and_its_exit_is_no_fault(tmp_path, monkeypatch):
    """A rank counts its launcher's faults as its own (`count_as_own`: the same start), so
    they never make its running fill gentle, while another program's still do; a launcher
    whose stat file goes away (it exited) keeps its last count instead of reading as a drop
    that would show up as others' faults."""
    vmstat, stat = _counters(tmp_path, 1000, 500)
    kin = tmp_path / "kin"
    kin_tmp = tmp_path / "kin.tmp"

    def launcher(count: int) -> None:
        kin_tmp.write_text(f"99 (python3) S 1 2 3 4 5 6 7 8 {count} 0 0 0 0\n")
        os.replace(kin_tmp, kin)

    launcher(300)
    monkeypatch.setattr(diskshare, "_KIN", [])
    diskshare.count_as_own(4242)
    diskshare.count_as_own(4242)
    assert diskshare._KIN == ["/proc/4242/stat"]  # once, whoever asks twice
    share = DiskShare(interval=0.01, window=0.2, faults=10, hold=0.2, source=vmstat,
                      own=False, own_source=stat, kin=(str(kin),), proc=NO_PROC).start()
    assert DiskShare(source=vmstat, own_source=stat).kin == ("/proc/4242/stat",)
    assert share.watching.wait(30)  # the sampler's first look: the counts it starts from
    try:
        system, theirs = 1000, 300
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the launcher faults: 5 every 10 ms
            system, theirs = system + 5, theirs + 5
            launcher(theirs)
            _counters(tmp_path, system, 500)
            time.sleep(0.01)
            assert not share.gentle, "the launcher's faults made the rank's fill gentle"
        # The sampler has seen the last count (a loaded machine may take a while).
        assert wait_until(lambda: share.stats()["own_faults"] == theirs - 300, 5)
        kin.unlink()  # the launcher exited
        time.sleep(0.1)
        assert not share.gentle, "the launcher's exit read as others' faults"
        system += 20  # another program faults
        _counters(tmp_path, system, 500)
        assert wait_until(lambda: share.gentle, 2), "others' faults went unseen"
    finally:
        stats = share.stop()
    assert stats["own_faults"] == theirs - 300 and stats["faults"] == system - 1000
    # [seconds, others', own, the launcher's]: its faults are named where they came
    kin_seen = sum(t[3] for t in stats["fault_times"])
    assert 0 < kin_seen <= theirs - 300
    assert all(t[3] <= t[2] for t in stats["fault_times"])


# Faults pages of a cold file in when told to, and says how many (its own ru_majflt).
_FAULTER = """
import mmap, os, resource, sys
if sys.argv[2] == "orphan" and os.fork():  # not our descendant: its parent exits at once
    os._exit(0)
path = sys.argv[1]
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
size = os.fstat(fd).st_size
before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
    m.madvise(mmap.MADV_RANDOM)
    total = sum(m[at] for at in range(0, size, size // 64))
print("faulted", resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("whose", ["another program", "a child of ours"])
def test_another_programs_faults_are_named_and_a_childs_count_as_our_own(cold_file, whose):
    """The real counters and /proc. A program that is not this process's descendant and
    faults pages of a cold file in makes the share gentle, and the sample that saw it names
    it (`comm:pid:faults`). A child of this process is part of it (a rank's `ldconfig`): its
    faults count as the share's own, and it is never named."""
    import subprocess
    import sys

    orphan = whose == "another program"
    proc = subprocess.Popen([sys.executable, "-c", _FAULTER, str(cold_file),
                             "orphan" if orphan else "child"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    share = None
    try:
        word, pid = proc.stdout.readline().split()
        assert word == "ready"
        share = DiskShare(own=False, hold=5.0).start()
        assert share.watching.wait(30)  # the monitor's first look at /proc
        proc.stdin.write("go\n")
        proc.stdin.flush()
        word, faults = proc.stdout.readline().split()
        assert word == "faulted"
        if int(faults) == 0:
            pytest.skip("the mapped pages came without major faults")
        if orphan:
            assert wait_until(lambda: share.gentle, 3), "the other program's faults went unseen"
        time.sleep(0.3)
    finally:
        stats = share.stop() if share is not None else {}
        proc.stdin.close()
        proc.wait(10)
    named = [n for row in stats["fault_times"] if len(row) > 4 for n in row[4]]
    theirs = [n for n in named if n.split(":")[1] == pid]
    assert all(int(n.split(":")[2]) > 0 for n in named)
    assert not any(n.split(":")[1] == str(os.getpid()) for n in named)
    if orphan:
        assert theirs, f"the faulting program was not named: {stats['fault_times']}"
    else:
        assert not theirs, f"our own child was named as another program: {named}"
        assert stats["own_faults"] >= int(faults)  # its faults are the share's own


def test_the_hold_runs_from_the_last_fault_not_from_the_end_of_its_window(tmp_path):
    """One short burst of another program's faults (a helper that starts and exits) makes the
    reads gentle for about HOLD, not for the window's length on top: on the H200, 4 faults that
    nobody could name made a cold READY gentle for 1.5-1.8 s."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    share = DiskShare(interval=0.01, window=2.0, hold=0.2, source=vmstat, own=False,
                      own_source=stat, proc=NO_PROC).start()
    try:
        assert share.watching.wait(30)  # the sampler's baseline
        _counters(tmp_path, 1004, 0)
        burst = time.monotonic()
        assert wait_until(lambda: share.gentle, 2), "the burst went unseen"
        assert wait_until(lambda: not share.gentle, 5)
        # From the window's end it would be 2.2 s; from the fault, 0.2 s and a sample or two.
        assert time.monotonic() - burst < 1.5
    finally:
        share.stop()


def test_the_processes_a_share_names_and_adopts_come_from_its_own_proc(tmp_path):
    """The share looks for the faulting processes where it was told to (`proc`), so made-up
    counters never meet real processes: a descendant of this process found there counts as
    its own from then on (never making the reads gentle), another program there is named, and
    this worker's real children (other tests' daemons) are neither."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    proc = tmp_path / "proc"
    me = os.getpid()

    def process(pid: int, comm: str, faults: int, parent: int) -> None:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        tmp = proc / f"{pid}.tmp"
        tmp.write_text(f"{pid} ({comm}) S {parent} 2 3 4 5 6 7 8 {faults} 0 0 0 0\n")
        os.replace(tmp, proc / str(pid) / "stat")

    process(me, "pytest", 0, 1)
    process(777, "ldconfig", 0, me)  # a child of this process
    process(888, "engine", 0, 1)  # another program
    share = DiskShare(interval=0.01, window=0.2, hold=0.2, source=vmstat, own=False,
                      own_source=stat, proc=str(proc)).start()
    try:
        assert share.watching.wait(30)  # the sampler's baseline and its first look at `proc`
        process(777, "ldconfig", 5, me)
        _counters(tmp_path, 1005, 0)  # the child's faults, seen as the system's first
        assert wait_until(lambda: share.stats()["own_faults"] == 5, 2), share.stats()
        time.sleep(0.1)
        assert not share.gentle and share.stats()["gentle_switches"] == 0
        process(888, "engine", 3, 1)
        _counters(tmp_path, 1008, 0)
        assert wait_until(lambda: share.gentle, 2), "the other program's faults went unseen"
    finally:
        stats = share.stop()
    named = [n for row in stats["fault_times"] if len(row) > 4 for n in row[4]]
    assert named == ["engine:888:3"], stats["fault_times"]
    assert stats["own_faults"] == 5 and stats["faults"] == 8


def test_the_start_gentle_knob_is_lenient_and_bounded(monkeypatch):
    """`WEIGHTCACHE_LOAD_START_GENTLE_S` (the rank's gentle start, for an A/B): seconds from 0
    to 60; anything else is the default, since a knob that only tunes speed never fails a
    start."""
    for value, want in (("", 0.5), ("junk", 0.5), ("-1", 0.5), ("61", 0.5), ("nan", 0.5),
                        ("0", 0.0), ("1.25", 1.25)):
        monkeypatch.setenv(loadenv.START_GENTLE_ENV, value)
        assert loadenv.start_gentle(0.5) == want, value


def test_a_program_that_keeps_faulting_holds_the_share_longer_than_a_blip(tmp_path):
    """Another program's faults over a span (an engine starting beside the load, reading files
    with `read()` between its faults) hold the reads gentle for that span after its last fault,
    up to `hold_max`; a blip of faults, later, holds only `hold` again. A share with no
    `hold_max` holds `hold` throughout, as before."""
    vmstat, stat = _counters(tmp_path, 1000, 0)
    kw = dict(interval=0.01, window=0.2, hold=0.2, source=vmstat, own=False, own_source=stat,
              proc=NO_PROC)
    fixed, growing = DiskShare(**kw).start(), DiskShare(hold_max=1.5, **kw).start()
    try:
        assert fixed.watching.wait(30) and growing.watching.wait(30)
        faults = 1000
        for _ in range(12):  # a program faulting every 0.1 s for 1.2 s
            faults += 2
            _counters(tmp_path, faults, 0)
            time.sleep(0.1)
        assert fixed.gentle and growing.gentle
        assert wait_until(lambda: not fixed.gentle, 5), "the fixed hold never ended"
        assert growing.gentle, "the growing hold ended with the fixed one"
        assert wait_until(lambda: not growing.gentle, 5), "the growing hold never ended"
        assert 1.0 <= growing.stats()["longest_hold"] <= 1.5
        assert fixed.stats()["longest_hold"] == 0.2
        time.sleep(1.6)  # quiet for longer than hold_max: the next fault begins an episode
        _counters(tmp_path, faults + 3, 0)  # a helper's blip
        assert wait_until(lambda: growing.gentle, 2), "the blip went unseen"
        blip = time.monotonic()
        assert wait_until(lambda: not growing.gentle, 5)
        assert time.monotonic() - blip < 1.2, "a blip after a quiet spell held like the start"
    finally:
        fixed.stop()
        growing.stop()


def test_the_hold_max_knob_is_lenient_and_bounded(monkeypatch):
    """`WEIGHTCACHE_LOAD_HOLD_MAX_S` (for an A/B: 1 is the fixed hold of before): seconds from
    0 to 60, anything else the default; a share never holds less than its `hold`."""
    for text, want in (("", 3.0), ("1", 1.0), ("0.5", 0.5), ("61", 3.0), ("-1", 3.0),
                       ("soon", 3.0)):
        monkeypatch.setenv(loadenv.HOLD_MAX_ENV, text)
        assert loadenv.hold_max(3.0) == want
    assert DiskShare(hold=1.0, hold_max=0.5).hold_max == 1.0
    assert DiskShare(hold=1.0).hold_max == 1.0
    monkeypatch.setenv(loadenv.HOLD_MAX_ENV, "2")
    share, started = diskshare.for_load()
    try:
        assert share is None or (started and share.hold_max == 2.0)
    finally:
        if share is not None:
            share.stop()


def test_the_hold_knob_sets_the_least_hold_and_is_lenient(monkeypatch):
    """`WEIGHTCACHE_LOAD_HOLD_S` (a blip's hold, for an A/B): seconds from 0 to 60, anything
    else the default; the share a load makes holds that long at least, and a hold above the
    longest raises the longest with it."""
    for text, want in (("", 1.0), ("0.5", 0.5), ("0", 0.0), ("61", 1.0), ("-1", 1.0),
                       ("later", 1.0)):
        monkeypatch.setenv(loadenv.HOLD_ENV, text)
        assert loadenv.hold(1.0) == want
    monkeypatch.delenv(loadenv.HOLD_MAX_ENV, raising=False)
    for text, hold, longest in (("0.5", 0.5, diskshare.HOLD_MAX), ("5", 5.0, 5.0)):
        monkeypatch.setenv(loadenv.HOLD_ENV, text)
        share, started = diskshare.for_load()
        try:
            assert share is None or (started and (share.hold, share.hold_max) == (hold, longest))
            if share is not None:
                assert share.stats()["hold"] == hold
        finally:
            if share is not None:
                share.stop()


def _reads(tmp_path: Path, system: int, own: int) -> tuple[str, str]:
    """A vmstat with no faults and `system` bytes read (`pgpgin`, KiB), and a proc_pid_io(5)
    with `own` bytes read."""
    vmstat, io = tmp_path / "vmstat", tmp_path / "io"
    tmp = tmp_path / "tmp"
    # The process's count first, as the kernel counts both where a read is sent: a sample
    # never sees the system's count of a read without the process's.
    tmp.write_text(f"rchar: 1\nwchar: 2\nread_bytes: {own}\nwrite_bytes: 0\n")
    os.replace(tmp, io)
    tmp.write_text(f"pgpgin {system // 1024}\npgmajfault 0\npswpin 0\n")
    os.replace(tmp, vmstat)
    return str(vmstat), str(io)


def test_a_read_counted_for_the_process_before_the_system_is_not_anothers(tmp_path):
    """The kernel counts a read for the process, then for the system (`submit_bio`). A sample
    that read its own count between the two holds the load's own read in its own count but
    not in the system's: as the window's base it would make that read another program's (a
    16 MiB read, within READ_FLOOR and READ_SHARE). The next sample as the base holds no such
    read, so only what others really read counts; a window of two samples (its monitor held
    up) counts nothing."""
    vmstat, io = _reads(tmp_path, 0, 0)
    share = DiskShare(source=vmstat, io_source=io, proc=NO_PROC)
    chunk, small = 16 * MiB, 64 * 1024  # a read of the load's; another's, below READ_FLOOR

    def window(raced: bool, theirs: int, count: int) -> deque:
        """(when, faults, own faults, system's reads, own before, own after) a read of the
        load's every 50 ms, the base's own count ahead by one read if `raced`, and `theirs`
        read by another program in the last 50 ms."""
        rows = [(0.05 * n, 0, 0, n * chunk, n * chunk, n * chunk) for n in range(count)]
        if raced:
            rows[0] = (0.0, 0, 0, 0, chunk, chunk)
        last = rows[-1]
        rows[-1] = (last[0], 0, 0, last[3] + theirs, last[4], last[5])
        return deque(rows)

    assert not share._others_reading(window(True, small, 8), (0, 0)), \
        "the load's own read passed for another program's"
    assert not share._others_reading(window(True, 0, 2), (0, 0))
    assert share.read_events == 0
    assert share._others_reading(window(True, 512 * 1024, 8), (0, 0))
    assert share._others_reading(window(False, 512 * 1024, 8), (0, 0))
    assert share.read_events == 2


def test_another_programs_reads_make_the_load_gentle_and_another_load_does_not(tmp_path):
    """A program that reads files with `read()` faults nothing: the disk's reads less this
    process's own say it is there (an engine's `import transformers` beside a fresh node's
    load). Reads as large as the load's own (another cache's load) do not count, nor does any
    read with the signal turned off."""
    vmstat, io = _reads(tmp_path, 0, 0)
    (tmp_path / "s").mkdir()
    _, stat = _counters(tmp_path / "s", 0, 0)
    kw = dict(interval=0.01, window=0.2, hold=0.2, source=vmstat, own=False, own_source=stat,
              proc=NO_PROC, io_source=io)
    share, off = DiskShare(**kw).start(), DiskShare(reads=False, **kw).start()
    try:
        assert share.reads and not off.reads
        assert share.watching.wait(30) and off.watching.wait(30)
        system = own = 0

        def step(mine: int, theirs: int, seconds: float) -> None:
            nonlocal system, own
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                own += mine
                system += mine + theirs
                _reads(tmp_path, system, own)
                time.sleep(0.01)

        step(64 * MiB, 0, 0.3)  # the load alone, at full rate
        assert not share.gentle and share.stats()["read_events"] == 0
        step(64 * MiB, 128 * 1024, 0.3)  # and a program reading 128 KiB each 10 ms
        assert share.gentle, "another program's reads went unseen"
        assert not off.gentle, "the signal was off"
        assert share.stats()["read_events"] > 0
        step(64 * MiB, 0, 0.6)  # it is done: full after the hold
        assert wait_until(lambda: not share.gentle, 5)
        # Another load, as large as this one: its first samples in the window look small
        # beside this load's, and count once; then never again.
        step(64 * MiB, 64 * MiB, 0.5)
        events = share.stats()["read_events"]
        step(64 * MiB, 64 * MiB, 0.8)
        assert share.stats()["read_events"] == events, "another load counted as a start"
        assert not share.gentle
    finally:
        stats = share.stop()
        off.stop()
    assert stats["others_read_bytes"] > 0 and stats["faults"] == 0


def test_the_read_counters_are_the_kernels(cold_file):
    """`pgpgin` and this process's `read_bytes` both grow when it reads a file the page cache
    does not hold."""
    disk, own = diskshare.read_disk_reads(), diskshare.read_own_reads()
    if disk is None or own is None:
        pytest.skip("no /proc/vmstat pgpgin or /proc/self/io here")
    fd = os.open(cold_file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, MiB):
            pass
    finally:
        os.close(fd)
    assert diskshare.read_own_reads() - own >= 16 * MiB
    assert diskshare.read_disk_reads() - disk >= 16 * MiB
    assert diskshare.read_disk_reads("/nonexistent/vmstat") is None
    assert diskshare.read_own_reads("/nonexistent/io") is None
