"""The import set: what a rank's start read, kept to be read ahead at its next start.

Real files, a real page cache (`POSIX_FADV_DONTNEED` and `cachestat`/`mincore` through
`residency`), real mappings, and the real launcher and rank for the round trip.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import pytest

from weightcache.native.shared import diskshare, importset
from weightcache.native.shared.coldload import drop_page_cache
from weightcache.native.shared.residency import resident, resident_pages
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

PAGE = mmap.PAGESIZE
SHAPE = LlamaShape(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def _file(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * PAGE))
    os.sync()
    drop_page_cache([path], everything=False)
    return path


def _resident(path: Path, start: int = 0, length: int | None = None) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident(fd, start, path.stat().st_size - start if length is None else length)
    finally:
        os.close(fd)


def test_a_mapped_file_lists_the_pages_it_faulted_and_a_prefetch_reads_them_back(tmp_path):
    """What this process mapped and touched is in the set; after the page cache dropped it, a
    prefetch of the set brings those pages back (and reads nothing of an excluded file)."""
    lib = _file(tmp_path / "lib.so", 512)
    skipped = _file(tmp_path / "weights.safetensors", 64)
    maps = []
    for f in (lib, skipped):
        fh = open(f, "rb")  # noqa: SIM115  (closed below, after the set is recorded)
        m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_RANDOM)  # no readahead: exactly the touched pages
        maps.append((fh, m))
    for page in (3, 4, 300):
        _ = maps[0][1][page * PAGE]
    _ = maps[1][1][0]
    found = importset.collect(exclude=[skipped])
    entry = next(f for f in found["files"] if f["path"] == str(lib))
    assert not any(f["path"] == str(skipped) for f in found["files"])
    covered = [(s, e) for s, e in entry["ranges"]]
    for page in (3, 4, 300):
        assert any(s <= page * PAGE and (page + 1) * PAGE <= e for s, e in covered)
    assert entry["identity"] == importset._identity(lib.stat())
    path = tmp_path / "set.json"
    assert importset.record(path, exclude=[skipped]) is not None  # while still mapped
    assert path.stat().st_mode & 0o777 == 0o600
    for fh, m in maps:
        m.close()
        fh.close()
    drop_page_cache([lib], everything=False)
    assert not _resident(lib, 300 * PAGE, PAGE)
    files = [f for f in importset.load(path) if f["path"] == str(lib)]
    pf = importset.Prefetch(files).start()
    assert pf.done.wait(30)
    stats = pf.stats()
    assert stats["files"] == 1 and stats["unread"] == 0 and stats["bytes"] >= 3 * PAGE
    assert _resident(lib, 300 * PAGE, PAGE) and _resident(lib, 3 * PAGE, 2 * PAGE)


def test_a_prefetch_reads_only_the_ranges_the_page_cache_lacks(tmp_path):
    """Where only the model is cold (a restart), the set is in memory already: a range held
    whole is not read (no memory copies in front of the early reads), a range the page cache
    lacks is, and the set still counts as read whole (the rank's share settles on it)."""
    held = tmp_path / "held.so"
    held.write_bytes(os.urandom(64 * PAGE))
    fd = os.open(held, os.O_RDONLY)
    try:
        os.pread(fd, 64 * PAGE, 0)  # in the page cache now
    finally:
        os.close(fd)
    if not _resident(held):
        pytest.skip("this kernel keeps no page cache for the test's files")
    cold = _file(tmp_path / "cold.so", 32)
    files = [{"path": str(f), "identity": importset._identity(f.stat()),
              "ranges": [(0, f.stat().st_size)]} for f in (held, cold)]
    pf = importset.Prefetch(files).start()
    assert pf.done.wait(30)
    stats = pf.stats()
    assert stats["resident_bytes"] == 64 * PAGE  # held: skipped
    assert stats["bytes"] == 32 * PAGE  # cold: read
    assert stats["files"] == 2 and stats["unread"] == 0 and pf.whole()
    assert _resident(cold)


def test_a_set_held_whole_is_done_on_one_check_with_nothing_read_or_looked_up(tmp_path):
    """Where every range of the set is in memory (only the model cold), the prefetch is done
    after one thread has checked it: no reads, no directory listings, and whole (the share
    settles). One file the page cache lacks, and the full prefetch runs as before."""
    def warm(path: Path) -> Path:
        path.write_bytes(os.urandom(16 * PAGE))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, 16 * PAGE, 0)
        finally:
            os.close(fd)
        return path

    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    held = [warm(tmp_path / "a.so"), warm(pkg / "__pycache__" / "m.cpython-312.pyc")]
    if not all(_resident(f) for f in held):
        pytest.skip("this kernel keeps no page cache for the test's files")

    def entry(f: Path) -> dict:
        return {"path": str(f), "identity": importset._identity(f.stat()),
                "ranges": [(0, f.stat().st_size)]}

    files = [entry(f) for f in held] + [{"path": str(pkg), "list": True}]
    pf = importset.Prefetch(files).start()
    assert pf.done.wait(30)
    stats = pf.stats()
    assert stats["checked_only"] is True and pf.whole()
    assert stats["bytes"] == 0 and stats["looked_up"] == 0
    assert stats["resident_bytes"] == 32 * PAGE and stats["files"] == 3
    cold = _file(tmp_path / "cold.so", 64)  # more than a third of the set's bytes missing
    pf = importset.Prefetch([*files, entry(cold)]).start()
    assert pf.done.wait(30)
    stats = pf.stats()
    assert stats["checked_only"] is False and stats["warm"] is False and pf.whole()
    assert stats["bytes"] == 64 * PAGE and stats["looked_up"] >= 1 and _resident(cold)
    (pkg / "__pycache__").rename(tmp_path / "moved")  # a listed directory gone: unread
    gone = importset.Prefetch([entry(held[0]), {"path": str(pkg / "__pycache__"),
                                                "list": True}]).start()
    assert gone.done.wait(30) and gone.stats()["unread"] == 1 and gone.needs_record()


def _warm_file(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, pages * PAGE, 0)
    finally:
        os.close(fd)
    return path


def _entry(f: Path) -> dict:
    return {"path": str(f), "identity": importset._identity(f.stat()),
            "ranges": [(0, f.stat().st_size)]}


def test_a_set_mostly_in_memory_lets_the_early_reads_go_before_its_read(tmp_path):
    """A restart finds its set in memory but for a part (what another process's start did
    not fault in): the verdict is warm, the early reads may go (`early_go`, the `when_warm`
    calls) before the missing part is read, and only the files lacking pages are read, with
    no look-ups. Half or more missing, and the early reads wait for the whole read, as on a
    cold node."""
    warm = [_warm_file(tmp_path / f"w{i}.so", 32) for i in range(4)]
    if not all(_resident(f) for f in warm):
        pytest.skip("this kernel keeps no page cache for the test's files")
    part = _file(tmp_path / "part.so", 32)
    fd = os.open(part, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead
        os.pread(fd, 4 * PAGE, 0)  # its first 4 pages in memory, 28 missing
    finally:
        os.close(fd)
    cold = _file(tmp_path / "cold.so", 8)
    files = [_entry(f) for f in (*warm, part, cold)]
    seen: list[tuple[bool, bool]] = []
    pf = importset.Prefetch(files)
    pf.when_warm(lambda: seen.append((pf.early_go.is_set(), pf.done.is_set())))
    pf.start()
    assert pf.done.wait(30) and pf.early_go.is_set()
    stats = pf.stats()
    # Called once, on the verdict: the early reads could go, the read was not done.
    assert seen == [(True, False)]
    assert stats["warm"] is True and stats["checked_only"] is False and pf.whole()
    assert stats["bytes"] == (32 + 8) * PAGE  # the ranges lacking pages; no held file re-read
    assert stats["resident_bytes"] == 4 * 32 * PAGE and stats["looked_up"] == 0
    assert stats["started_at"] <= stats["census_at"] <= stats["warm_at"] <= stats["done_at"]
    assert _resident(part) and _resident(cold)
    late: list[bool] = []
    pf.when_warm(lambda: late.append(True))  # a verdict already given: called at once
    assert late == [True]
    # The knob off (the earlier way): the same set is read whole first, look-ups and all.
    drop_page_cache([part, cold], everything=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(importset.WARM_ENV, "0")
        off = importset.Prefetch(files)
        off.when_warm(lambda: late.append(False))
        assert off.start().done.wait(30) and off.whole() and late == [True]
    stats = off.stats()
    assert stats["warm"] is False and stats["looked_up"] >= 1 and stats["bytes"] >= 40 * PAGE

    drop_page_cache([*warm[:3]], everything=False)  # now over a third of the set is missing
    seen.clear()
    cold_set = importset.Prefetch([_entry(f) for f in (*warm, part)])
    cold_set.when_warm(lambda: seen.append((True, True)))
    cold_set.start()
    assert cold_set.done.wait(30) and cold_set.early_go.is_set() and seen == []
    stats = cold_set.stats()
    assert stats["warm"] is False and stats["warm_at"] is None and cold_set.whole()
    assert stats["bytes"] == 3 * 32 * PAGE and stats["looked_up"] >= 1


def test_a_cold_node_is_told_within_a_few_dozen_files(tmp_path, monkeypatch):
    """On a cold node the census stops once COLD_FILES files with no page in memory make most
    of those it saw, even where their bytes are a small share of the set (here one large file
    held whole): the whole set is read, the early reads wait for it."""
    monkeypatch.setattr(importset, "COLD_FILES", 4)
    big = _warm_file(tmp_path / "big.so", 256)
    if not _resident(big):
        pytest.skip("this kernel keeps no page cache for the test's files")
    small = [_file(tmp_path / f"a{i:02d}.pyc", 1) for i in range(6)]
    pf = importset.Prefetch([_entry(f) for f in (*small, big)])
    pf.start()
    assert pf.done.wait(30)
    stats = pf.stats()
    # By bytes (6 pages missing of 262) it would be warm: the empty files told it cold.
    assert stats["warm"] is False and pf.whole() and stats["bytes"] == 6 * PAGE
    assert stats["looked_up"] >= 1  # the full read, with its look-ups
    # Files with no page in memory, but fewer than those held (a restart): still warm. (One
    # looker, so that the files are counted in the set's order.)
    monkeypatch.setattr(importset, "CENSUS_THREADS", 1)
    warm = [_warm_file(tmp_path / f"b{i:02d}.so", 64) for i in range(8)]
    restart = importset.Prefetch([_entry(f) for f in (*warm, *small[:5])])
    drop_page_cache(small[:5], everything=False)
    restart.start()
    assert restart.done.wait(30) and restart.stats()["warm"] is True and restart.whole()


def test_the_prefetchs_own_opens_are_not_noted_as_the_starts(tmp_path):
    """The census and the reads open the set's own files: a start that writes its set anew
    must not note those opens as its own (each would come back as a whole file, and the set
    grow at every rewrite). Warm and cold verdicts alike."""
    warm = [_warm_file(tmp_path / f"w{i}.so", 16) for i in range(3)]
    if not all(_resident(f) for f in warm):
        pytest.skip("this kernel keeps no page cache for the test's files")
    cold = [_file(tmp_path / f"c{i}.so", 16) for i in range(3)]
    names = {str(f) for f in (*warm, *cold)}
    verdicts = []
    importset.watch_opens()
    try:
        for files in ([*warm, cold[0]], cold[1:]):  # a warm verdict, then a cold one
            pf = importset.Prefetch([_entry(f) for f in files]).start()
            assert pf.done.wait(30) and pf.whole()
            verdicts.append(pf.stats()["warm"])
        with open(warm[0], "rb"):  # the start's own open is still noted
            pass
        paths, _ = importset._opened()
    finally:
        importset.stop_watching()
    assert verdicts == [True, False] and str(warm[0]) in paths
    assert not (names - {str(warm[0])}) & paths


@pytest.mark.parametrize("how", ["deep", "plain"])
def test_a_deep_prefetch_also_looks_up_what_the_import_reads_and_both_read_the_same(
        tmp_path, monkeypatch, how):
    """A deep prefetch (the default) lists each directory of the set once and looks up each
    bytecode file's source, which the import stats; the plain one looks up nothing. Both read
    exactly the ranges the page cache lacks, and leave them resident."""
    monkeypatch.setenv(importset.PREFETCH_ENV, how)
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "mod.py").write_text("x = 1\n")
    pyc = _file(pkg / "__pycache__" / "mod.cpython-312.pyc", 8)
    init = _file(pkg / "__pycache__" / "__init__.cpython-312.pyc", 4)  # no source: skipped
    big = _file(tmp_path / "lib.so", 256)
    files = [{"path": str(f), "identity": importset._identity(f.stat()), "ranges": ranges}
             for f, ranges in ((big, [(0, 64 * PAGE), (128 * PAGE, 256 * PAGE)]),
                               (init, [(0, 4 * PAGE)]), (pyc, [(0, 8 * PAGE)]))]
    pf = importset.Prefetch(files).start()
    assert pf.done.wait(30)
    stats = pf.stats()
    assert stats["deep"] is (how == "deep")
    # tmp_path, pkg/__pycache__ and pkg listed once each, pkg/mod.py looked up.
    assert stats["looked_up"] == (4 if how == "deep" else 0)
    assert stats["bytes"] == (64 + 128 + 4 + 8) * PAGE and pf.whole()
    assert _resident(big, 0, 64 * PAGE) and _resident(big, 128 * PAGE, 128 * PAGE)
    assert _resident(pyc) and _resident(init)


def test_a_changed_file_is_skipped_and_module_files_are_whole(tmp_path):
    """A file whose identity changed since the set was written is not read at all; imported
    modules are listed with their whole bytecode file."""
    f = _file(tmp_path / "a.bin", 16)
    ident = importset._identity(f.stat())
    time.sleep(0.01)
    f.write_bytes(os.urandom(16 * PAGE))  # same size, new mtime
    os.sync()
    drop_page_cache([f], everything=False)
    pf = importset.Prefetch([{"path": str(f), "identity": ident,
                              "ranges": [(0, 16 * PAGE)]}]).start()
    assert pf.done.wait(30)
    assert pf.stats()["unread"] == 1 and pf.stats()["bytes"] == 0
    fd = os.open(f, os.O_RDONLY)
    assert (resident_pages(fd, 0, 16 * PAGE) or (0, 0))[0] == 0
    os.close(fd)
    found = importset.collect()
    cached = importset.__spec__.cached
    mine = cached if cached and os.path.isfile(cached) else importset.__file__
    entry = next(e for e in found["files"] if e["path"] == mine)
    assert entry["ranges"] == [[0, os.stat(mine).st_size]]


@pytest.mark.parametrize("how", ["garbage", "old version", "group writable", "symlink",
                                 "bad entries", "unknown mtime resolution"])
def test_a_set_we_cannot_trust_or_parse_is_ignored(tmp_path, how):
    path = tmp_path / "set.json"
    good = {"version": importset.VERSION, "files": [
        {"path": str(tmp_path / "x"), "identity": [3, 4], "ranges": [[0, 10]]}]}
    if how == "garbage":
        path.write_bytes(b"\x00{not json")
    elif how == "old version":
        path.write_text(json.dumps({**good, "version": 0}))
    elif how == "group writable":
        path.write_text(json.dumps(good))
        os.chmod(path, 0o620)
    elif how == "symlink":
        (tmp_path / "real.json").write_text(json.dumps(good))
        path.symlink_to(tmp_path / "real.json")
    elif how == "unknown mtime resolution":  # only nanoseconds, or a seed's whole seconds
        path.write_text(json.dumps({**good, "mtime_resolution_ns": 1000}))
    else:
        path.write_text(json.dumps({"version": importset.VERSION, "files": [
            {"path": 5}, {"path": "/x", "identity": [1, "2"], "ranges": [[0, 1]]},
            {"path": "/y", "identity": [1, 2], "ranges": [[5, 1], "z"]},
            {"path": "/z", "identity": [1, 2, 3, 4], "ranges": [[0, 1]]}]}))
    assert importset.load(path) == []
    if how == "group writable":  # the same set, private again: taken
        os.chmod(path, 0o600)
        assert importset.load(path) != []
    if how == "symlink":  # the file it points to, named itself: taken
        assert importset.load(tmp_path / "real.json") != []


def test_the_set_path_follows_the_knob(tmp_path, monkeypatch):
    monkeypatch.delenv(importset.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert importset.set_path() == tmp_path / "cache" / "weightcache" / importset.SET_NAME
    monkeypatch.setenv(importset.ENV, "off")
    assert importset.set_path() is None
    monkeypatch.setenv(importset.ENV, str(tmp_path / "elsewhere.json"))
    assert importset.set_path() == tmp_path / "elsewhere.json"


def test_a_rank_writes_its_set_and_reads_it_ahead_at_its_next_start(tmp_path, sock_dir,
                                                                      preload):
    """Through the real launcher and rank: the first start finds no set and writes one into
    the user's cache directory (torch's libraries and modules among it, nothing in the socket
    directory); the next start reads it before importing torch and says so in READY; `off`
    does neither."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    args = ("--model", str(model), "--weight-cache-socket-dir", str(sock_dir))
    env = {k: v for k, v in os.environ.items() if k != importset.ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    p = preload(*args, env=env)
    first_ready = p.wait_ready(120)["rank_loads"][0]
    first = first_ready["import_prefetch"]
    assert first["files"] == 0 and first["bytes"] == 0 and first["done"]
    # By default torch waits for the set: here there was none, so it did not wait for one.
    assert first["import_waited"] is not None and 0 <= first["import_waited"] < 0.5
    set_file = tmp_path / "cache" / "weightcache" / importset.SET_NAME
    deadline = time.monotonic() + 60
    while not set_file.exists():
        assert time.monotonic() < deadline, "the rank wrote no import set"
        time.sleep(0.1)
    files = importset.load(set_file)
    assert any("/torch/" in f["path"] and ".so" in f["path"] for f in files)
    assert any(f["path"].endswith(".pyc") for f in files)
    assert not any(f["path"].endswith(".safetensors") for f in files)
    # `import torch` reads every installed distribution's entry points (torch/__init__.py,
    # `_import_device_backends`: `importlib.metadata.entry_points(group="torch.backends")`): no
    # mapping or module shows those files, and on the H200 a cold start waited 3-5 s on
    # them behind the early reads. The start's opens put them in the set, and the
    # directories looked in for a missing one.
    if _distributions_with_entry_points():
        assert any(f["path"].endswith("/entry_points.txt") for f in files)
        assert any(f.get("list") and f["path"].endswith(".dist-info") for f in files)
    p.stop()
    written = set_file.stat().st_mtime_ns
    p = preload(*args, env=env)
    ready = p.wait_ready(120)["rank_loads"][0]
    again = ready["import_prefetch"]
    assert again["done"] and again["files"] > 0
    assert again["bytes"] + again["resident_bytes"] > 0  # read, or found in memory already
    # The set was read whole, so the rank's disk share was settled (diskshare.settle); the
    # first start had none to read, so its share was not.
    if diskshare.read_faults() is not None:
        assert ready["loader"]["disk"]["settled_at"] is not None
        assert first_ready["loader"]["disk"]["settled_at"] is None
    # By default the rank imported torch only once the set was read (it waited, and not for
    # the whole bound: the set was read by then).
    assert again["import_waited"] is not None
    assert 0 <= again["import_waited"] < importset.MAX_SECONDS
    if ready["early"] is not None:  # by default the early reads started at once, gentle
        assert ready["early"]["waited_seconds"] is None
    time.sleep(1)  # a rank would write its set right after READY
    p.stop()
    assert set_file.stat().st_mtime_ns == written  # it still matched: kept as it was
    # Early reads after the set (1): they wait for it, then go at once, settled.
    # Torch imported beside the read (WAIT 0): its import did not wait.
    p = preload(*args, env={**env, importset.EARLY_WAIT_ENV: "1", importset.WAIT_ENV: "0"})
    beside = p.wait_ready(120)["rank_loads"][0]
    if beside["early"] is not None:
        assert beside["early"]["waited_seconds"] is not None
    assert beside["import_prefetch"]["import_waited"] is None
    assert beside["import_prefetch"]["done"] and beside["import_prefetch"]["files"] > 0
    if diskshare.read_faults() is not None:
        assert beside["loader"]["disk"]["settled_at"] is not None
    p.stop()
    # Read in a process of its own (1): the same set read, the share settled, READY says so.
    p = preload(*args, env={**env, importset.PROCESS_ENV: "1"})
    apart = p.wait_ready(120)["rank_loads"][0]
    assert apart["import_prefetch"]["apart"] is True and apart["import_prefetch"]["done"]
    assert apart["import_prefetch"]["files"] > 0 and apart["import_prefetch"]["unread"] == 0
    if diskshare.read_faults() is not None:
        assert apart["loader"]["disk"]["settled_at"] is not None
    p.stop()
    assert not any("import-set" in n for n in os.listdir(sock_dir))
    set_file.unlink()
    p = preload(*args, env={**env, importset.ENV: "off"})
    assert p.wait_ready(120)["rank_loads"][0]["import_prefetch"] is None
    time.sleep(1)  # a rank would write its set right after READY
    p.stop()
    assert not set_file.exists()


def test_a_nodes_first_start_reads_the_seed_then_writes_its_own_set(tmp_path, sock_dir,
                                                                     preload):
    """The seed (`weightcache import-set record`, as the agent image's build runs it): a
    readable 0644 file of torch's libraries and modules. A rank whose node has no set of its
    own reads the seed ahead (READY says `seeded`), then writes the node's own set, which the
    next start reads instead. `off` reads neither."""
    import subprocess
    import sys

    seed = tmp_path / "image" / "import-set.seed.json"
    env = {k: v for k, v in os.environ.items() if k not in (importset.ENV, importset.SEED_ENV)}
    (tmp_path / "a-file").write_text("")  # a path it can never write: said at once, exit 1
    bad = subprocess.run([sys.executable, "-m", "weightcache.cli", "import-set", "record",
                          str(tmp_path / "a-file" / "seed.json")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "cannot write" in bad.stderr and not bad.stdout
    done = subprocess.run([sys.executable, "-m", "weightcache.cli", "import-set", "record",
                           str(seed)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["path"] == str(seed) and said["files"] > 100 and said["bytes"] > 0
    assert seed.stat().st_mode & 0o777 == 0o644 and seed.parent.stat().st_mode & 0o777 == 0o755
    files = importset.load(seed)
    assert len(files) == said["files"]
    # Its files' mtimes to the second, as an image layer keeps them on every node.
    written = json.loads(seed.read_text())
    assert written["mtime_resolution_ns"] == importset.IMAGE_MTIME_NS
    assert all(f["identity"][1] % importset.IMAGE_MTIME_NS == 0
               for f in written["files"] if "identity" in f)
    assert any("/torch/" in f["path"] and ".so" in f["path"] for f in files)
    assert any("/weightcache/native/shared/" in f["path"]  # the fill's module (or its bytecode)
               and "coldload" in f["path"] for f in files)
    # The arena's transports, which a rank imports only when it allocates: read cold behind
    # the checkpoint's reads where the seed lacked them (rank.import_for_fill).
    for name in ("cuda_vmm", "memfd"):
        assert any("/weightcache/native/shared/transport/" in f["path"] and name in f["path"]
                   for f in files), name
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    args = ("--model", str(model), "--weight-cache-socket-dir", str(sock_dir))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env[importset.SEED_ENV] = str(seed)
    own = tmp_path / "cache" / "weightcache" / importset.SET_NAME
    p = preload(*args, env=env)
    first = p.wait_ready(120)["rank_loads"][0]["import_prefetch"]
    assert first["seeded"] is True and first["done"]
    assert first["files"] + first["unread"] == len(files)
    assert first["bytes"] + first["resident_bytes"] > 0  # read, or found in memory already
    deadline = time.monotonic() + 60
    while not own.exists():
        assert time.monotonic() < deadline, "a start that read the seed wrote no set"
        time.sleep(0.1)
    p.stop()
    mine = importset.load(own)
    assert mine and not any(f["path"] == str(seed) for f in mine)  # the seed is not the start's
    assert "mtime_resolution_ns" not in json.loads(own.read_text())  # the node's: nanoseconds
    p = preload(*args, env=env)
    again = p.wait_ready(120)["rank_loads"][0]["import_prefetch"]
    assert again["seeded"] is False and again["files"] > 0
    p.stop()
    own.unlink()
    p = preload(*args, env={**env, importset.ENV: "off"})
    assert p.wait_ready(120)["rank_loads"][0]["import_prefetch"] is None
    p.stop()


_RECORD = """
import sys
from pathlib import Path
from weightcache.native.shared import importset
importset.watch_opens()
for name in sys.argv[3:]:
    with open(name, "rb") as fh:
        fh.read()
if sys.argv[2] == "seed":  # as the image's build writes it
    importset.record(Path(sys.argv[1]), shared=True, whole_seconds=True)
else:  # as a node's start writes its own
    importset.record(Path(sys.argv[1]))
"""


def test_a_seed_holds_for_an_image_layers_copies_of_its_files(tmp_path):
    """The seed is recorded where the image is built, and read on nodes whose copies of those
    files came out of the image's layer tars. A layer keeps a file's mtime to the whole second
    (containerd `archive/tar.go` and moby `pkg/archive`: `hdr.ModTime.Truncate(time.Second)`),
    so the build's 12:00:00.734 is a node's 12:00:00.000. A seed's entries still hold there,
    and a node's own set (recorded on the node) still tells any change to the nanosecond."""
    import subprocess
    import sys

    (tmp_path / "lib").mkdir()
    files = [_file(tmp_path / "lib" / name, pages) for name, pages in
             (("libtorch_fake.so", 8), ("module.cpython-312.pyc", 2))]
    for i, f in enumerate(files):  # written mid-second, as a build's files are
        t = 1_780_000_000 * importset.IMAGE_MTIME_NS + 734_512_001 + i
        os.utime(f, ns=(t, t))
    seed, own = tmp_path / "image" / "seed.json", tmp_path / "node" / "own.json"
    for path, kind in ((seed, "seed"), (own, "own")):
        done = subprocess.run([sys.executable, "-c", _RECORD, str(path), kind,
                               *map(str, files)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    def read(path: Path) -> dict:
        entries = [f for f in importset.load(path) if f["path"] in map(str, files)]
        assert len(entries) == len(files), entries
        drop_page_cache(files, everything=False)
        pf = importset.Prefetch(entries).start()
        assert pf.done.wait(30)
        return pf.stats()

    def layer_copy() -> None:  # what extracting the layer leaves: the mtime cut to the second
        for f in files:
            m = f.stat().st_mtime_ns
            os.utime(f, ns=(m - m % importset.IMAGE_MTIME_NS,) * 2)

    assert read(seed)["unread"] == 0  # at the build, before any layer
    layer_copy()
    on_node = read(seed)
    assert on_node["unread"] == 0 and on_node["bytes"] == 10 * PAGE, on_node
    assert all(_resident(f) for f in files)  # read ahead, whole
    assert read(own)["unread"] == len(files)  # a node's set: the cut mtime is a change
    later = files[0].stat().st_mtime_ns + importset.IMAGE_MTIME_NS
    os.utime(files[0], ns=(later, later))  # another second: another file
    with open(files[1], "ab") as fh:  # another size: another file
        fh.write(b"x")
    assert read(seed)["unread"] == 2


def test_the_seed_recorder_drops_the_installed_files_from_the_page_cache_first():
    """A seed recorded over a warm page cache names whole libraries (an image's build has just
    written them): on the development machine 302 MB against a cold start's 144 MB, and the
    seeded start was the slowest (docs/results/cpu-2026-12-06-seed). The recorder drops the
    interpreter's and the packages' files first: a module file read whole is not resident
    after it, where its file system lets pages go at all."""
    import sysconfig

    from weightcache.native.daemon import seedset

    stdlib = Path(sysconfig.get_path("stdlib"))
    probe = next(p for p in (stdlib / "turtle.py", stdlib / "pydoc.py", stdlib / "difflib.py")
                 if p.exists())
    probe.read_bytes()
    fd = os.open(probe, os.O_RDONLY)
    try:
        if not resident(fd, 0, probe.stat().st_size):
            pytest.skip("the file's pages did not stay in the page cache")
        if seedset.evict_libraries() == 0:
            pytest.fail("no installed file was seen")
        if resident(fd, 0, probe.stat().st_size):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if resident(fd, 0, probe.stat().st_size):  # e.g. tmpfs: nothing can be dropped
                pytest.skip("this file system keeps the pages")
            pytest.fail(f"{probe} was not dropped")
    finally:
        os.close(fd)


def _started(own: Path) -> importset.Prefetch:
    """A rank's start as far as its import set: the prefetch `start_prefetch` chose, done."""
    found, prefetch = importset.start_prefetch()
    importset.stop_watching()  # this test process's opens are no start's
    assert found == own and prefetch is not None
    assert prefetch.done.wait(30)
    return prefetch


def test_a_seed_is_read_only_where_the_nodes_set_is_missing_and_only_if_trusted(
        tmp_path, monkeypatch):
    """The seed may be root's (the image's build) or this user's, never writable by others;
    the node's own set, where there is one we trust, wins."""
    lib = _file(tmp_path / "lib.so", 4)
    ident = importset._identity(lib.stat())

    def write(path: Path, pages: int) -> Path:
        path.write_text(json.dumps({"version": importset.VERSION, "files": [
            {"path": str(lib), "identity": ident, "ranges": [[0, pages * PAGE]]}]}))
        os.chmod(path, 0o644)
        return path

    seed, own = write(tmp_path / "seed.json", 1), tmp_path / "own.json"
    monkeypatch.setenv(importset.ENV, str(own))
    monkeypatch.setenv(importset.SEED_ENV, str(seed))

    first = _started(own)
    assert first.seeded and first.files[0]["ranges"] == [(0, PAGE)] and first.needs_record()
    write(own, 2)
    os.chmod(own, 0o600)
    second = _started(own)
    assert not second.seeded and second.files[0]["ranges"] == [(0, 2 * PAGE)]
    assert not second.needs_record()
    own.unlink()
    os.chmod(seed, 0o664)  # writable by its group: not trusted
    assert _started(own).files == []
    os.chmod(seed, 0o644)
    if os.getuid() == 0:  # root can give it to another user, whose seed is not trusted
        os.chown(seed, 4321, 4321)
        assert _started(own).files == []
        assert importset.load(seed, owners=(4321,)) != []
    monkeypatch.setenv(importset.SEED_ENV, "off")
    assert importset.seed_path() is None and _started(own).files == []
    monkeypatch.setenv(importset.ENV, "off")
    monkeypatch.setenv(importset.SEED_ENV, str(seed))
    assert importset.start_prefetch() == (None, None)


def test_a_nodes_set_of_another_images_files_gives_way_to_this_images_seed(
        tmp_path, monkeypatch):
    """An agent upgrade: the node's set was recorded under the old image's seed and names the
    old image's files, every one of which would be skipped as changed, so the start would be as
    slow as one with no set. It reads the new image's seed instead, and writes its own set
    anew. Under the same seed it reads its own set; a set that names no seed (recorded before
    sets did) is read as before; where the seed cannot be trusted, the node's set stays."""
    lib = _file(tmp_path / "lib.so", 4)
    ident = importset._identity(lib.stat())
    seed, own = tmp_path / "seed.json", tmp_path / "own.json"

    def write(path: Path, pages: int, image: list[int] | None = None) -> None:
        data: dict = {"version": importset.VERSION, "files": [
            {"path": str(lib), "identity": ident, "ranges": [[0, pages * PAGE]]}]}
        if image is not None:
            data["seed"] = image
        path.write_text(json.dumps(data))
        os.chmod(path, 0o644 if path == seed else 0o600)

    monkeypatch.setenv(importset.ENV, str(own))
    monkeypatch.setenv(importset.SEED_ENV, str(seed))
    write(seed, 1)
    image = [seed.stat().st_size, seed.stat().st_mtime_ns]
    written = importset.record(tmp_path / "recorded.json")  # a node's set names its seed
    assert written is not None and written["seed"] == image
    write(own, 2, image)
    same = _started(own)
    assert not same.seeded and same.files[0]["ranges"] == [(0, 2 * PAGE)]
    later = image[1] + importset.IMAGE_MTIME_NS
    os.utime(seed, ns=(later, later))  # the new image's seed
    upgraded = _started(own)
    assert upgraded.seeded and upgraded.files[0]["ranges"] == [(0, PAGE)]
    assert upgraded.needs_record()
    write(own, 2)  # names no seed
    assert not _started(own).seeded
    write(own, 2, image)
    os.chmod(seed, 0o664)  # writable by its group: not trusted, so the node's set stays
    kept = _started(own)
    assert not kept.seeded and kept.files[0]["ranges"] == [(0, 2 * PAGE)]


def _distributions_with_entry_points() -> bool:
    import importlib.metadata

    return any(d.read_text("entry_points.txt") for d in importlib.metadata.distributions())


def test_what_the_start_opens_and_looks_for_is_in_the_set_and_read_ahead(tmp_path):
    """Files a start opens for reading (small ones, whole), and the directory of one it looked
    for and missed, go into the set; files it wrote, large ones, the model's own directory and
    anything after the set is collected do not. A prefetch then reads the file back and lists
    the directory."""
    small = _file(tmp_path / "entry_points.txt", 2)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (importset.OPENED_MAX_BYTES + PAGE))
    written = tmp_path / "out.txt"
    looked = tmp_path / "dist.dist-info"
    looked.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    weights, config = model / "w.safetensors", model / "config.json"
    weights.write_bytes(b"w" * PAGE)
    config.write_text("{}")
    importset.watch_opens()
    small.read_bytes()
    big.read_bytes()
    written.write_text("x")
    config.read_text()  # the model's own: beside an excluded file, so never in the set
    os.listdir(model)
    with pytest.raises(FileNotFoundError):
        open(looked / "missing.txt")  # noqa: SIM115
    found = importset.collect(exclude=[weights])
    later = _file(tmp_path / "later.txt", 1)
    later.read_bytes()  # after the collect: not watched any more
    entries = {f["path"]: f for f in found["files"]}
    assert entries[str(small)]["ranges"] == [[0, 2 * PAGE]]
    assert entries[str(looked)] == {"path": str(looked), "list": True}
    for absent in (big, written, later, config, weights, model):
        assert str(absent) not in entries
    # Watching ended with that collect: the next one sees no opens at all.
    assert str(small) not in {f["path"] for f in importset.collect()["files"]}
    importset.watch_opens()  # a start whose set still matched stops watching unrecorded
    small.read_bytes()
    importset.stop_watching()
    assert str(small) not in {f["path"] for f in importset.collect()["files"]}
    set_file = tmp_path / "set.json"
    set_file.write_text(json.dumps(found))
    set_file.chmod(0o600)
    loaded = importset.load(set_file)
    assert {"path": str(looked), "list": True} in loaded
    mine = [f for f in loaded if f["path"] in (str(small), str(looked))]
    drop_page_cache([small], everything=False)
    assert not _resident(small)
    prefetch = importset.Prefetch(mine, deep=True).start()
    assert prefetch.done.wait(10) and prefetch.whole()
    assert _resident(small)
    stats = prefetch.stats()
    assert stats["files"] == 2 and stats["unread"] == 0 and stats["looked_up"] >= 1
    looked.rmdir()  # a directory gone since: unread, so the set is written anew
    gone = importset.Prefetch([{"path": str(looked), "list": True}]).start()
    assert gone.done.wait(10) and gone.stats()["unread"] == 1 and gone.needs_record()


def test_a_set_is_written_anew_only_when_missing_or_stale(tmp_path):
    """A start on a warm node would record every cached page of the libraries it maps, so a
    set that still matches is kept; none, or one naming a changed file, is written anew."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"x" * 8192)
    ident = importset._identity(lib.stat())
    fresh = importset.Prefetch([{"path": str(lib), "identity": ident, "ranges": [(0, 8192)]}])
    fresh.start().done.wait(10)
    assert fresh.stats()["files"] == 1 and not fresh.needs_record()
    nothing = importset.Prefetch([]).start()
    assert nothing.needs_record()
    stale = importset.Prefetch([{"path": str(lib), "identity": [ident[0], ident[1] + 1],
                                 "ranges": [(0, 8192)]}])
    stale.start().done.wait(10)
    assert stale.stats()["unread"] == 1 and stale.needs_record()


def test_a_set_written_anew_does_not_name_itself(tmp_path):
    """The start that writes a set anew read the old one first (its open is seen); naming
    the set in itself would make it stale at once, and every later start would write it
    again. So the next start finds it matching and keeps it."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"x" * 8192)
    set_file = tmp_path / "state" / "import-set.json"
    set_file.parent.mkdir(mode=0o700)
    set_file.write_text(json.dumps({"version": importset.VERSION, "files": [
        {"path": str(lib), "identity": [1, 2], "ranges": [[0, 8192]]}]}))  # stale
    set_file.chmod(0o600)
    importset.watch_opens()
    try:
        stale = importset.Prefetch(importset.load(set_file)).start()
        assert stale.done.wait(10) and stale.needs_record()
        lib.read_bytes()
        written = importset.record(set_file)
    finally:
        importset.stop_watching()
    assert written is not None
    names = {f["path"] for f in written["files"]}
    assert str(lib) in names and str(set_file) not in names
    again = importset.Prefetch(importset.load(set_file)).start()
    assert again.done.wait(10) and not again.needs_record()


def test_a_whole_set_says_so_once_read_and_calls_back_on_done(tmp_path):
    """`whole()` (the rank settles its disk share on it) only for a non-empty set read as
    recorded; `when_done` calls back once, at once when it is done already."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"x" * 8192)
    ident = importset._identity(lib.stat())
    calls: list[bool] = []
    fresh = importset.Prefetch([{"path": str(lib), "identity": ident, "ranges": [(0, 8192)]}])
    fresh.when_done(lambda: calls.append(fresh.whole()))
    assert not fresh.whole()  # not started, not read
    fresh.start().done.wait(10)
    assert calls == [True] and fresh.whole()
    fresh.when_done(lambda: calls.append(fresh.whole()))  # done already: called here
    assert calls == [True, True]
    nothing = importset.Prefetch([])
    nothing.when_done(lambda: calls.append(nothing.whole()))
    nothing.start()
    assert calls[-1] is False  # no set: the libraries may be cold
    stale = importset.Prefetch([{"path": str(lib), "identity": [ident[0], ident[1] + 1],
                                 "ranges": [(0, 8192)]}])
    stale.start().done.wait(10)
    assert not stale.whole()


def test_the_rank_process_reads_its_set_ahead_before_it_imports_numpy_or_torch(tmp_path):
    """`python -m weightcache.native.daemon` starts the read-ahead first: what it imports for
    that must not pull in numpy or torch, whose files are what the set reads ahead."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from weightcache.native.shared.importset import start_prefetch\n"
            "found, prefetch = start_prefetch()\n"
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules), found,"
            " prefetch is not None)\n")
    env = {**os.environ, importset.ENV: str(tmp_path / "set.json")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["[]", str(tmp_path / "set.json"), "True"]
    env[importset.ENV] = "off"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["[]", "None", "False"]


def test_a_rank_or_an_engine_starts_no_program_of_its_own_while_it_imports(tmp_path):
    """Importing the rank's and the engine's modules (torch with them) runs no other program:
    a child such as `ldconfig -p` (which `ctypes.util.find_library` runs) faults its binary
    in from a cold disk, beside the rank's early reads, and costs every engine a fork."""
    import subprocess
    import sys

    code = ("import sys\n"
            "seen = []\n"
            "sys.addaudithook(lambda ev, args: seen.append(str(args[1])) if ev in\n"
            "                 ('subprocess.Popen', 'os.posix_spawn', 'os.exec', 'os.system')\n"
            "                 else None)\n"
            "from weightcache.native.shared.importset import start_prefetch\n"
            "start_prefetch()\n"
            "import weightcache.native.daemon.rank\n"
            "import weightcache.native.engine.attach\n"
            "from weightcache.native.shared import libc\n"
            "assert libc.function('mincore', []) is not None\n"
            "print('spawned', seen)\n")
    env = {**os.environ, importset.ENV: str(tmp_path / "set.json")}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()
    assert out[-1] == "spawned []"


def test_a_deep_prefetch_puts_a_whole_range_in_flight_not_one_readahead_window(tmp_path):
    """One `POSIX_FADV_WILLNEED` call reads at most the kernel's readahead window of a range
    (8 MiB here): `ahead` asks in AHEAD_BYTES pieces, so the whole range comes in without a
    read of ours."""
    size = 64 << 20
    path = _file(tmp_path / "big.so", size // PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert (resident_pages(fd, 0, size) or (1, 0))[0] == 0
        importset.ahead(fd, 0, size)
        deadline = time.monotonic() + 10
        while (resident_pages(fd, 0, size) or (0, 0))[0] < size // PAGE:
            assert time.monotonic() < deadline, f"only {resident_pages(fd, 0, size)} resident"
            time.sleep(0.02)
    finally:
        os.close(fd)


def test_a_cold_set_is_read_by_as_many_readers_as_the_knob_says(tmp_path, monkeypatch):
    """`WEIGHTCACHE_IMPORT_SET_THREADS` sets a deep prefetch's readers (never more than the
    files); a rank refuses a bad value before it loads, and the prefetch itself takes one as
    the default."""
    from weightcache.native.shared import loadenv

    cold = [_file(tmp_path / f"lib{i}.so", 8) for i in range(6)]
    files = [{"path": str(f), "identity": importset._identity(f.stat()),
              "ranges": [(0, f.stat().st_size)]} for f in cold]
    for value, readers in (("3", 3), ("64", 6), (None, 6)):
        if value is None:
            monkeypatch.delenv(importset.THREADS_ENV, raising=False)
        else:
            monkeypatch.setenv(importset.THREADS_ENV, value)
        drop_page_cache(cold, everything=False)
        pf = importset.Prefetch(files, deep=True).start()
        assert pf.done.wait(30)
        stats = pf.stats()
        assert stats["readers"] == readers and stats["files"] == 6, stats
        assert stats["bytes"] + stats["resident_bytes"] == 6 * 8 * PAGE
        assert all(_resident(f) for f in cold)
    monkeypatch.delenv(importset.THREADS_ENV, raising=False)
    assert importset.prefetch_threads() == importset.THREADS
    for bad in ("0", "-1", "many", str(importset.MAX_THREADS + 1)):
        monkeypatch.setenv(importset.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=importset.THREADS_ENV):
            loadenv.check()
        assert importset.prefetch_threads() in (importset.THREADS, importset.MAX_THREADS)
    monkeypatch.setenv(importset.THREADS_ENV, str(importset.MAX_THREADS))
    loadenv.check()
    assert importset.prefetch_threads() == importset.MAX_THREADS
