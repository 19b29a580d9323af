"""The fill digests what it reads, once, and a file changing under it is an error, never a signal.

The content record built from the fill's own buffers must equal the audit digest
(`content.digest_files`, a separate full read) for every layout, tensor-parallel share and
dtype conversion; a file truncated, rewritten or replaced while a load runs must raise an
error that names it (the old CPU loader mapped the files: a truncation was SIGBUS for the
process, exit -7, and a rank left its lock behind); a signal during the load stops every
reader thread before it propagates.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from weightcache.native.shared import content
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.native.shared.loader import load_into_arena, plan_layout
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

# Tensors of a few hundred KiB, so that files span several content chunks and several jobs.
SHAPE = LlamaShape(hidden=256, layers=2, intermediate=768, vocab=1024, heads=4, kv_heads=2,
                   tied=False)


@pytest.fixture(scope="module", params=[1, 3, 20])
def model(request, tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("onepass") / "m", SHAPE,
                                  files=request.param)


def _layout(model: Path, tp_size: int = 1, tp_rank: int = 0, dtype: str = "auto"):
    ckpt = open_checkpoint(model)
    return ckpt, plan_layout(ckpt, rules=parse_rules(None), tp_size=tp_size, tp_rank=tp_rank,
                             dtype=dtype)


@pytest.mark.parametrize(("tp_size", "tp_rank", "dtype"),
                         [(1, 0, "auto"), (2, 1, "auto"), (1, 0, "float32")])
def test_the_fill_record_is_the_full_digest(model, tp_size, tp_rank, dtype):
    ckpt, lay = _layout(model, tp_size, tp_rank, dtype)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    want = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_into_arena(lay, flat, digest=list(ckpt.files))
    load_into_arena(lay, want)  # no digest: the bytes must not depend on it
    audit = content.digest_files(ckpt.files)
    assert stats.record == audit
    assert content.content_root(stats.record) == content.content_root(audit)
    assert torch.equal(flat, want)
    assert all(d.hash == content.HASH for d in audit.values())
    claim = content.sample_claim(ckpt.files)
    assert claim["hash"] == content.HASH
    assert content.verify_claim(stats.record, claim) is None


def test_small_reads_still_digest_on_the_chunk_grid(model):
    """A chunk size below the content chunk: digested jobs still cover whole chunks."""
    from weightcache.native.shared.coldload import load_entries

    ckpt, lay = _layout(model)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_entries(list(lay.entries), flat, threads=3, chunk=64 << 10, direct=False,
                         digest=list(ckpt.files))
    assert stats.record == content.digest_files(ckpt.files)


@pytest.mark.parametrize("mib", ["1", "3", "16"])
def test_any_hash_piece_gives_the_same_arena_and_record(tmp_path, monkeypatch, mib):
    """`WEIGHTCACHE_LOAD_HOT_STEP_MIB` changes only how a page-cache read is cut for its hash
    (a piece of one chunk, of three, of a whole read): the arena and the content record are
    the same, for a file that ends mid-piece too."""
    from safetensors.torch import save_file

    from weightcache.native.shared.coldload import load_entries

    g = torch.Generator().manual_seed(1)
    save_file({"a": torch.randint(0, 255, (37, 1 << 20), dtype=torch.uint8, generator=g),
               "b": torch.randint(0, 255, (3, 12345), dtype=torch.uint8, generator=g)},
              str(tmp_path / "model.safetensors"))
    ckpt, lay = _layout(tmp_path)
    want = torch.zeros(lay.nbytes, dtype=torch.uint8)
    load_into_arena(lay, want)
    monkeypatch.setenv("WEIGHTCACHE_LOAD_HOT_STEP_MIB", mib)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_entries(list(lay.entries), flat, threads=2, direct=False,
                         digest=list(ckpt.files))
    assert torch.equal(flat, want)
    assert stats.record == content.digest_files(ckpt.files)
    assert stats.hash_seconds > 0  # hashed by the readers, from their own reads


def test_the_hash_piece_follows_the_readers_that_take_turns(tmp_path, monkeypatch):
    """A fill whose CPU work runs in many readers hashes page-cache reads in 16 MiB pieces (their
    turns at the GIL dominate), a fill of few readers in 4 MiB (the piece still in the CPU's
    cache); the knob sets either; the arena and the record are the same whatever the piece."""
    from safetensors.torch import save_file

    from weightcache.native.shared import cgroups, coldload
    from weightcache.native.shared.coldload import load_entries

    monkeypatch.delenv("WEIGHTCACHE_LOAD_HOT_STEP_MIB", raising=False)
    assert coldload.hot_step(1) == coldload.hot_step(coldload.WIDE_SLOTS - 1) == 4 << 20
    assert coldload.hot_step(coldload.WIDE_SLOTS) == coldload.hot_step(64) == 16 << 20
    monkeypatch.setenv("WEIGHTCACHE_LOAD_HOT_STEP_MIB", "2")
    assert coldload.hot_step(1) == coldload.hot_step(64) == 2 << 20
    monkeypatch.delenv("WEIGHTCACHE_LOAD_HOT_STEP_MIB")

    g = torch.Generator().manual_seed(2)
    save_file({"a": torch.randint(0, 255, (40, 1 << 20), dtype=torch.uint8, generator=g)},
              str(tmp_path / "model.safetensors"))
    ckpt, lay = _layout(tmp_path)
    want = torch.zeros(lay.nbytes, dtype=torch.uint8)
    load_into_arena(lay, want)
    pieces = {}
    for cpus in (2, 16):  # the machine's CPUs as its cgroup allows them
        monkeypatch.setattr(cgroups, "usable_cpus", lambda n=cpus: n)
        flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
        stats = load_entries(list(lay.entries), flat, threads=16, chunk=4 << 20,
                             direct=False, digest=list(ckpt.files))  # 10 reads: 10 readers
        assert torch.equal(flat, want)
        assert stats.record == content.digest_files(ckpt.files)
        pieces[cpus] = stats.as_dict()["hot_step_mib"]
    assert pieces == {2: 4, 16: 16}


def test_a_claim_of_another_hash_or_an_old_client_is_refused(model):
    ckpt, _ = _layout(model)
    record = content.digest_files(ckpt.files)
    claim = content.sample_claim(ckpt.files)
    assert claim["hash"] == content.HASH == "blake3-128"  # the wheel is a dependency
    other = {**claim, "hash": "sha256-128"}  # a client without the wheel
    assert "sha256-128" in (content.verify_claim(record, other) or "")
    old = {k: v for k, v in claim.items() if k != "hash"}
    assert "older client" in (content.verify_claim(record, old) or "")


_TRUNCATE_MID_LOAD = r"""
import os, sys, torch
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.loader import load_into_arena, plan_layout
from weightcache.native.shared.sharding import parse_rules
ckpt = open_checkpoint(sys.argv[1])
victim = max(ckpt.files, key=lambda f: f.stat().st_size)
lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
done = []
def progress(n):
    if not done:
        done.append(n)
        os.truncate(victim, victim.stat().st_size // 3)
try:
    load_into_arena(lay, flat, progress=progress)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
else:
    print("LOADED")
"""


def test_a_file_truncated_mid_load_is_an_error_naming_it_not_sigbus(tmp_path):
    """Old code: the CPU loader's mmap faults on the truncated pages, SIGBUS (rc -7)."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    victim = open_checkpoint(model).files[0]
    env = {**os.environ, "WEIGHTCACHE_LOAD_THREADS": "1", "WEIGHTCACHE_LOAD_CHUNK_MIB": "1"}
    out = subprocess.run([sys.executable, "-P", "-c", _TRUNCATE_MID_LOAD, str(model)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("REFUSED ContentError"), out.stdout + out.stderr[-2000:]
    assert str(victim) in out.stdout and "truncated" in out.stdout, out.stdout


@pytest.mark.parametrize("how", ["rewrite", "replace"])
def test_a_file_changed_mid_load_never_yields_a_record(tmp_path, how):
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=2)
    ckpt, lay = _layout(model)
    victim = ckpt.files[-1]
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    done: list[int] = []

    def progress(n: int) -> None:
        if done:
            return
        done.append(n)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        if how == "rewrite":  # same inode, same size: only mtime/ctime tell
            with open(victim, "r+b") as fh:
                fh.seek(len(data) - 1)
                fh.write(data[-1:])
        else:  # a new file renamed over the path (what a download tool does)
            tmp = victim.with_suffix(".new")
            tmp.write_bytes(bytes(data))
            os.replace(tmp, victim)

    with pytest.raises(content.ContentError, match=str(victim)):
        load_into_arena(lay, flat, progress=progress, digest=list(ckpt.files))
    assert done


def test_a_signal_during_the_load_stops_every_reader(tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=20)
    ckpt, lay = _layout(model)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)

    class Stop(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Stop()

    def slow(n: int) -> None:
        time.sleep(0.2)

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        t0 = time.monotonic()
        with pytest.raises(Stop):
            load_into_arena(lay, flat, progress=slow, digest=list(ckpt.files))
        stopped = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("coldload-")]
    assert alive == []
    jobs = sum(1 for _ in lay.entries)
    assert stopped < 0.2 * jobs  # not the whole load: each reader stopped after one job


def test_a_rank_whose_checkpoint_is_truncated_exits_1_and_leaves_nothing(tmp_path, sock_dir,
                                                                         preload):
    """The launcher reports the rank's documented exit 1 and the file; no lock is left.

    The file is truncated the moment the rank holds its lock (before its fill opens the
    files: importing torch takes seconds). Old code: SIGBUS, launcher exit 135, stale lock.
    """
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=1)
    victim = open_checkpoint(model).files[0]
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir))
    lock = Path(f"{socket_path(sock_dir, cpu_identity(0))}.lock")
    deadline = time.monotonic() + 60
    while not lock.exists():
        assert time.monotonic() < deadline and p.proc.poll() is None, p.proc.poll()
        time.sleep(0.01)
    os.truncate(victim, victim.stat().st_size // 2)
    code = p.proc.wait(120)
    err = p.proc.stderr.read()
    assert code == 1, err
    assert str(victim) in err and "truncated" in err, err
    assert "Traceback" not in err, err
    assert os.listdir(sock_dir) == [], os.listdir(sock_dir)


# Tensors of several chunks each, so that half a tensor is whole chunks.
WIDE = LlamaShape(hidden=1024, layers=1, intermediate=2048, vocab=2048, heads=8, kv_heads=4,
                  tied=False)


def test_a_tensor_parallel_rank_digests_its_share_and_claims_sample_within_it(tmp_path):
    """TP ranks read and hash only the chunks their tensors come from (not every file whole);
    the client samples among the same chunks (its own layout), so identity holds for every
    byte the rank serves, and a claim sampled outside the share is refused."""
    from weightcache.native.shared.coldload import share_chunks

    model = write_llama_checkpoint(tmp_path / "wide", WIDE, files=2)
    ckpt, _ = _layout(model)
    audit = content.digest_files(ckpt.files)
    seen: set[tuple[str, int]] = set()
    for rank in range(2):
        _, lay = _layout(model, 2, rank)
        flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
        stats = load_into_arena(lay, flat, digest=list(ckpt.files), share=True)
        share = {p.name: c for p, c in share_chunks(list(lay.entries)).items()}
        record = stats.record
        hashed = sum(len(d.covered) for d in record.values())
        assert hashed < sum(d.n_chunks for d in audit.values())  # not every file whole
        for name, d in record.items():
            assert d.covered == frozenset(share.get(name, ()))
            for i in d.covered:  # the digests it holds are the audit's
                assert d.chunk(i) == audit[name].chunk(i)
                seen.add((name, i))
        claim = content.sample_claim(ckpt.files, coverage=share)
        assert content.verify_claim(record, claim) is None
        outside = {n: [i for i in range(audit[n].n_chunks) if i not in share.get(n, ())]
                   for n in audit}
        name = next(n for n, idx in outside.items() if idx)
        bad = content.sample_claim(ckpt.files, coverage={**share, name: outside[name]})
        assert "not in this rank's share" in (content.verify_claim(record, bad) or "")
        # A changed chunk inside the share is caught: its digest differs.
        wrong = {**claim, "files": dict(claim["files"])}
        entry = dict(wrong["files"][name])
        index = entry["samples"][0][0]
        entry["samples"] = [[index, bytes(16)], *entry["samples"][1:]]
        wrong["files"][name] = entry
        assert "differs" in (content.verify_claim(record, wrong) or "")
    # Together the ranks cover every chunk that holds tensor bytes.
    assert seen


def test_a_load_is_warm_only_when_the_page_cache_holds_every_file_whole(tmp_path):
    """A CUDA fill sets one reader per core when the page cache holds every file it opened
    (no disk to keep busy), 32 otherwise: the answer comes from the kernel, not from a guess."""
    from weightcache.native.shared.coldload import _all_resident, drop_page_cache

    files = [tmp_path / f"f{i}" for i in range(2)]
    for f in files:
        f.write_bytes(os.urandom(8 << 20))
    opened = {f: os.open(f, os.O_RDONLY) for f in files}
    try:
        for f in files:
            f.read_bytes()
        assert _all_resident(opened)
        drop_page_cache([files[1]], everything=False)
        assert not _all_resident(opened)
        files[1].read_bytes()
        assert _all_resident(opened)
        assert not _all_resident({})
    finally:
        for fd in opened.values():
            os.close(fd)
