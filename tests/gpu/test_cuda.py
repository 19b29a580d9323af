"""CUDA transports, the cold loader and the daemon on a real GPU (marked `gpu`).

Memory is checked with device and per-process queries (cudaMemGetInfo, NVML), not logs.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import pytest
import torch

from weightcache.native.shared import coldload, content, gpu, identity
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.loader import load_into_arena, plan_layout
from weightcache.native.shared.sharding import parse_rules
from weightcache.native.shared.transport import TransportError, _cuda, get_transport

from .conftest import PROBE, daemon_command, run_probe, write_checkpoint

pytestmark = pytest.mark.gpu
MiB = 1 << 20
DEV = torch.device("cuda", 0)


def free_bytes() -> int:
    # Blocks torch's caching allocator keeps (e.g. temporaries of torch.equal) count as used.
    torch.cuda.synchronize(DEV)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(DEV)[0]


def process_gpu_bytes(pid: int) -> int | None:
    """GPU memory NVML attributes to `pid` (host PID namespace), None when NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return None
    return sum((p.usedGpuMemory or 0) for p in procs if p.pid == pid)


def test_device_uuid_and_visible_devices_remap():
    uuid = gpu.device_uuid(0)
    assert uuid == gpu.normalize_uuid(uuid)
    assert identity.device_identity("cuda", 0) == uuid  # socket names use the same identity
    code = "from weightcache.native.shared import gpu; print(gpu.device_uuid(0))"
    for visible in (uuid, uuid[:12], os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        assert out.stdout.strip() == uuid


def test_vmm_arena_maps_twice_without_new_memory_and_frees():
    transport = get_transport("cuda_vmm")
    nbytes = 1024 * MiB
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV)
    free0 = free_bytes()
    arena = transport.allocate(nbytes, DEV)
    free1 = free_bytes()
    assert free0 - free1 >= nbytes
    arena.tensor().copy_(pattern)
    meta, fds = arena.export()
    assert meta["transport"] == "cuda_vmm" and meta["size"] % (2 * MiB) == 0
    imported = transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    view = imported.tensor()  # mapped when first used
    free2 = free_bytes()
    assert abs(free1 - free2) < 64 * MiB  # a second mapping adds no memory
    assert torch.equal(view, pattern)
    arena.tensor()[:16].fill_(7)  # zero copy: both map the same bytes
    torch.cuda.synchronize(DEV)
    assert int(view[:16].sum()) == 7 * 16
    arena_memory = weakref.ref(arena._memory)
    imported_memory = weakref.ref(imported._memory)
    arena.close()
    imported.close()
    assert free_bytes() < free0 - nbytes // 2  # the view still holds the memory
    assert arena_memory() is None and imported_memory() is not None
    del view
    gc.collect()
    state = {"imported_alive": imported_memory() is not None,
             "release_errors": list(_cuda.RELEASE_ERRORS), "free0": free0,
             "free_now": free_bytes()}
    print("vmm in-process free check", json.dumps(state), flush=True)
    assert free_bytes() >= free0 - 256 * MiB, state  # arena (1 GiB) back; lazy modules stay


def test_vmm_arena_of_pieces_maps_lazily_and_copies_a_piece_at_a_time():
    """An arena of 3 allocations (one fd each) is one flat range to the daemon and to a
    client: zero copy sees the daemon's bytes and writes, `copy_into` copies them piece by
    piece into a block, asks for the block only once the first piece is mapped, and each
    allocation is freed once nothing maps it."""
    from weightcache.native.shared.transport import cuda_vmm

    gran = cuda_vmm.granularity(0)
    nbytes = 5 * gran + 12345  # the last piece partly used
    transport = get_transport("cuda_vmm")
    free0 = free_bytes()
    arena = cuda_vmm.VmmArena(nbytes, 0, count=3)
    assert arena.sizes == [2 * gran, 2 * gran, 2 * gran] and arena.size == 6 * gran
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV)
    arena.tensor().copy_(pattern)
    meta, fds = arena.export()
    assert len(fds) == 3 and meta["pieces"] == arena.sizes
    # Zero copy: the three pieces side by side, the daemon's writes seen.
    imported = transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    assert imported._span.mapped == []  # nothing mapped until used
    view = imported.tensor()
    assert len(imported._span.mapped) == 3 and torch.equal(view, pattern)
    arena.tensor()[-16:].fill_(9)
    torch.cuda.synchronize(DEV)
    assert int(view[-16:].sum()) == 9 * 16
    imported.close()
    del view
    # Copy mode: the block asked for after the first piece is mapped, bytes equal.
    pattern[-16:] = 9
    copier = transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    asked: list[int] = []

    def take() -> torch.Tensor:
        asked.append(len(copier._span.mapped))
        return torch.zeros(nbytes + 100, dtype=torch.uint8, device=DEV)

    block = copier.copy_into(take, nbytes)
    torch.cuda.synchronize(DEV)
    assert asked == [1] and len(copier._span.mapped) == 3
    assert torch.equal(block[:nbytes], pattern) and int(block[nbytes:].sum()) == 0
    copier.close()
    # Bad exports are refused, their fds closed.
    for bad in ({**meta, "pieces": arena.sizes[:2]}, {**meta, "pieces": [gran, gran, 0]}):
        dups = [os.dup(fd) for fd in fds[: len(bad["pieces"])]]
        with pytest.raises(TransportError):
            transport.attach(bad, dups, DEV)
        for fd in dups:
            with pytest.raises(OSError):
                os.fstat(fd)
    arena.close()
    del block, imported
    gc.collect()
    assert free_bytes() >= free0 - 64 * MiB, _cuda.RELEASE_ERRORS


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_daemon_serves_an_arena_of_pieces(daemon_factory, medium_model, monkeypatch, mode):
    """A daemon told `WEIGHTCACHE_VMM_PIECES=4` serves its arena as 4 allocations, and an
    engine attaches either way with the checkpoint's bytes (the probe checks them)."""
    from weightcache.native.engine.attach import query

    monkeypatch.setenv("WEIGHTCACHE_VMM_PIECES", "4")
    daemon = daemon_factory(medium_model, "cuda_vmm")
    code, report = run_probe(medium_model, daemon.socket, mode)
    assert code == 0, report
    assert report["source"] == "cache" and report["verified"] is True
    assert query(daemon.socket, "get_memory")["bytes"] == daemon.info["bytes"]


def test_vmm_refuses_another_gpus_arena():
    transport = get_transport("cuda_vmm")
    arena = transport.allocate(4 * MiB, DEV)
    try:
        meta, fds = arena.export()
        meta = {**meta, "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
        with pytest.raises(TransportError, match="lives on GPU"):
            transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    finally:
        arena.close()


@pytest.mark.parametrize("preflight", ["1", "0"])
def test_legacy_ipc_in_one_process_fails_cleanly(monkeypatch, preflight):
    from weightcache.native.shared.transport.cuda_ipc import IpcIsolationError

    monkeypatch.setenv("WEIGHTCACHE_IPC_PREFLIGHT", preflight)
    transport = get_transport("cuda_ipc")
    arena = transport.allocate(4 * MiB, DEV)
    try:
        meta, fds = arena.export()
        assert fds == [] and len(bytes.fromhex(meta["handle"])) == 64
        with pytest.raises(IpcIsolationError, match="legacy CUDA IPC cannot attach"):
            transport.attach(meta, [], DEV)
    finally:
        arena.close()
    torch.empty(1, device=DEV).add_(1)  # the context is still healthy
    torch.cuda.synchronize(DEV)


@pytest.mark.parametrize(("tp", "dtype", "direct"),
                         [(1, "auto", False), (2, "float16", True), (1, "auto", "auto")])
def test_coldload_into_cuda_matches_reference(small_model, tp, dtype, direct):
    ckpt = open_checkpoint(small_model)
    for rank in range(tp):
        layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=tp, tp_rank=rank, dtype=dtype)
        want = torch.zeros(layout.nbytes, dtype=torch.uint8)
        load_into_arena(layout, want)
        got = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
        stats = coldload.load_entries(list(layout.entries), got, threads=4, chunk=MiB,
                                      direct=direct, digest=list(ckpt.files))
        assert stats.nbytes == sum(e.nbytes for e in layout.entries)
        # The digest hashed in the reader threads from the pinned buffers is the audit's.
        assert stats.record == content.digest_files(ckpt.files)
        got = got.cpu()
        for e in layout.entries:
            assert torch.equal(got[e.offset : e.offset + e.nbytes],
                               want[e.offset : e.offset + e.nbytes]), e.name


@pytest.mark.parametrize("budget_chunks", [2, 1 << 20])
def test_coldload_into_cuda_takes_early_reads(small_model, budget_chunks):
    """Jobs read while a rank starts reach the device through the pinned buffers, same bytes
    and same record as a fill that reads them itself."""
    from weightcache.native.shared.earlyread import EarlyReads

    ckpt = open_checkpoint(small_model)
    layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
    want = torch.zeros(layout.nbytes, dtype=torch.uint8)
    load_into_arena(layout, want)
    early = EarlyReads(ckpt.files, budget_chunks * MiB, chunk=MiB, threads=2, direct=False).start()
    early.join()
    got = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
    stats = coldload.load_entries(list(layout.entries), got, threads=4, chunk=MiB,
                                  digest=list(ckpt.files), early=early)
    assert stats.early_bytes == early.taken_bytes == early.read_bytes > 0
    assert stats.record == content.digest_files(ckpt.files)
    early.close()
    got = got.cpu()
    for e in layout.entries:
        assert torch.equal(got[e.offset : e.offset + e.nbytes],
                           want[e.offset : e.offset + e.nbytes]), e.name


@pytest.mark.parametrize("tp", [2, 4])
def test_coldload_into_cuda_takes_a_tensor_parallel_ranks_early_reads(medium_model, tp):
    """A tensor-parallel rank's early jobs (its own chunks, planned from the headers:
    tpshare.py) reach the device through the pinned buffers: same bytes and same record as a
    fill that reads them itself. One GPU holds each rank's arena in turn."""
    from weightcache.native.shared import tpshare
    from weightcache.native.shared.coldload import share_chunks
    from weightcache.native.shared.earlyread import EarlyReads

    ckpt = open_checkpoint(medium_model)
    rules = parse_rules(None)
    for rank in range(tp):
        layout = plan_layout(ckpt, rules=rules, tp_size=tp, tp_rank=rank)
        want = torch.zeros(layout.nbytes, dtype=torch.uint8)
        plain = coldload.load_entries(list(layout.entries), want, threads=4, chunk=4 * MiB,
                                      direct=False, digest=list(ckpt.files), share=True)
        early = EarlyReads(ckpt.files, 1 << 40, chunk=4 * MiB, threads=2, direct=False,
                           plan=lambda r=rank: tpshare.own_chunks(ckpt, rules, tp, r)).start()
        early.join()
        assert early.own and early.own.keys() <= share_chunks(layout.entries).keys()
        got = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
        stats = coldload.load_entries(list(layout.entries), got, threads=4, chunk=4 * MiB,
                                      direct=False, digest=list(ckpt.files), share=True,
                                      early=early)
        assert stats.early_bytes == early.taken_bytes == early.read_bytes > 0
        assert stats.record == plain.record
        early.close()
        got = got.cpu()
        for e in layout.entries:
            assert torch.equal(got[e.offset : e.offset + e.nbytes],
                               want[e.offset : e.offset + e.nbytes]), e.name


@pytest.mark.parametrize("transport", ["cuda_vmm", "cuda_ipc"])
@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_daemon_serves_and_client_attaches(daemon_factory, medium_model, transport, mode):
    daemon = daemon_factory(medium_model, transport)
    nbytes = daemon.info["bytes"]
    held0 = process_gpu_bytes(daemon.proc.pid)
    code, report = run_probe(medium_model, daemon.socket, mode)
    assert code == 0, report
    assert report["source"] == "cache" and report["verified"] is True
    if mode == "zero_copy":
        # Mapping the daemon's arena adds no weight memory on the device.
        assert report["free_delta"] < nbytes // 4, report
    else:
        # Copy mode leaves the daemon's arena in place for later engines (docs/native.md,
        # "Release"): the daemon still holds it, and the next engine is served from it.
        from weightcache.native.engine.attach import query

        assert query(daemon.socket, "get_memory")["bytes"] == nbytes
        held1 = process_gpu_bytes(daemon.proc.pid)
        if held0 is not None and held1 is not None:
            print("daemon GPU bytes before/after a copy-mode attach", held0, held1)
            assert held1 >= held0 - nbytes * 0.1
        code, again = run_probe(medium_model, daemon.socket, "zero_copy")
        assert code == 0 and again["source"] == "cache", again


def test_copy_mode_attaches_share_one_allocating_thread(daemon_factory, medium_model):
    """Two copy-mode attaches in one process: each gets its own block with the checkpoint's
    bytes, and both were allocated by the one thread the process keeps (`_Allocator`), which
    also unmapped the arena after each copy: once it has, the daemon's release gives the
    arena's memory back to the device (a mapping left in this process would keep it)."""
    import threading

    from safetensors.torch import load_file

    from weightcache.native.engine import attach as client
    from weightcache.native.engine.attach import query

    daemon = daemon_factory(medium_model, "cuda_vmm")
    nbytes = daemon.info["bytes"]
    results = [client.attach(medium_model, device="cuda:0", socket_path=daemon.socket,
                             mode="copy", fallback=False) for _ in range(2)]
    assert [t.name for t in threading.enumerate()].count("weightcache-alloc") == 1
    assert client._Allocator.settle(30)
    assert _cuda.RELEASE_ERRORS == []
    before = free_bytes()
    reply = query(daemon.socket, "release")
    assert reply["ok"] and reply["freed"] is True
    time.sleep(0.5)
    assert free_bytes() - before >= nbytes * 0.9
    first, second = (r.state_dict for r in results)
    assert all(r.source == "cache" and r.mode == "copy" for r in results)
    want: dict[str, torch.Tensor] = {}
    for f in sorted(medium_model.glob("*.safetensors")):
        want.update(load_file(f))
    assert set(first) >= set(want)
    for name, tensor in want.items():
        assert first[name].data_ptr() != second[name].data_ptr()  # two blocks, not one
        assert torch.equal(first[name].cpu(), tensor), name
        assert torch.equal(second[name].cpu(), tensor), name


@pytest.mark.parametrize("kept", [False, True])
def test_copy_mode_refused_loads_from_disk_without_its_block(daemon_factory, tmp_path, kept):
    """A copy-mode attach refused once its block was asked for (a file touched since the
    daemon loaded it: the claim is refused) loads from disk, and that load does not find the
    block still held: this process's peak is about one copy of the shard, not two. `kept`:
    the block was asked for ahead, by the size of the plan an earlier attach kept
    (`_Destination.guess`), before the touch made that plan stale."""
    from safetensors.torch import load_file

    from weightcache.native.engine import attach as client
    from weightcache.native.engine import plancache

    model = write_checkpoint(tmp_path / "model", layers=2, hidden=2048)
    daemon = daemon_factory(model, "cuda_vmm")
    nbytes = daemon.info["bytes"]
    if kept:
        time.sleep(plancache.RACY_S + 0.1)  # a plan of files this new would not be kept
        first = client.attach(model, device=DEV, socket_path=daemon.socket, mode="copy",
                              fallback=False)
        assert first.source == "cache"
        del first
        assert client.PLANS.peek(client._plan_key(model, 1, 0, None, "auto")) is not None
    os.utime(sorted(model.glob("*.safetensors"))[0])  # a touch: the daemon refuses the claim
    free_bytes()
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    res = client.attach(model, device=DEV, socket_path=daemon.socket, mode="copy")
    peak = torch.cuda.max_memory_allocated(DEV) - base
    assert res.source == "disk" and res.reason.startswith("fingerprint_mismatch"), res.reason
    print("copy refused, then disk: peak", peak, "shard", nbytes)
    assert nbytes * 0.9 <= peak < nbytes * 1.5
    for f in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            assert torch.equal(res.state_dict[name].cpu(), tensor), name


def test_rank_named_by_the_launchers_uuid_checks_it(daemon_factory, medium_model):
    """A rank handed its device's UUID (`--device-uuid`, as the launcher does) serves under
    it; handed another GPU's, it refuses to serve once its CUDA context shows the truth
    (exit 1), leaving no socket and no lock behind."""
    from weightcache.contracts.vocabulary import EXIT_ERROR

    uuid = (gpu.visible_device_uuids() or [None])[0]
    assert uuid == gpu.device_uuid(0)
    daemon = daemon_factory(medium_model, "cuda_vmm", suffix=["--device-uuid", uuid])
    assert daemon.info["device"] == uuid and daemon.socket.endswith(f"/{uuid}.sock")
    assert daemon.stop() == 0
    wrong = "GPU-00000000-0000-0000-0000-000000000000"
    root = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))  # socket paths: <= 107 bytes
    try:
        sockets = root / "s"
        cmd = [*daemon_command(medium_model, sockets, "cuda_vmm"), "--device-uuid", wrong]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert done.returncode == EXIT_ERROR, done.stderr[-2000:]
        assert "refusing to serve under the wrong name" in done.stderr
        assert "SERVING" not in done.stdout
        assert not any(sockets.iterdir())  # neither the socket nor its lock file
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_release_and_exit_give_memory_back(daemon_factory, medium_model):
    from weightcache.native.engine.attach import query

    torch.empty(1, device=DEV)
    base = free_bytes()
    daemon = daemon_factory(medium_model, "cuda_vmm")
    nbytes = daemon.info["bytes"]
    loaded = free_bytes()
    assert base - loaded >= nbytes
    reply = query(daemon.socket, "release")
    assert reply["ok"] and reply["released"] == nbytes
    # No engine attached zero_copy: the daemon says the memory is really freed.
    assert reply["still_mapped"] == 0 and reply["freed"] is True
    time.sleep(0.5)
    released = free_bytes()
    print("free bytes: base", base, "loaded", loaded, "released", released)
    assert released - loaded >= nbytes * 0.9
    assert daemon.stop() == 0
    time.sleep(0.5)
    assert free_bytes() >= base - 64 * MiB  # the daemon's context is gone too


@pytest.mark.parametrize("transport", ["cuda_vmm"])
def test_zero_copy_engine_outlives_its_daemon(daemon_factory, medium_model, transport):
    daemon = daemon_factory(medium_model, transport)
    cmd = [sys.executable, PROBE, "--model", str(medium_model), "--socket", daemon.socket,
           "--outlive-daemon"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first == {"watching": True}
    assert daemon.stop() == 0
    report = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=120) == 0, report
    print("outlive", json.dumps(report))
    assert report["daemon_gone_seen"] is True
    assert report["verified_after_daemon_exit"] is True


def test_release_of_a_cuda_ipc_arena_is_refused_once_engines_map_it(daemon_factory,
                                                                    medium_model):
    """Legacy CUDA IPC memory freed by its exporter is gone for its importers too: once an
    engine attached zero_copy, `release` answers `busy` and the arena stays."""
    from weightcache.native.engine.attach import query

    daemon = daemon_factory(medium_model, "cuda_ipc")
    code, report = run_probe(medium_model, daemon.socket, "zero_copy")
    assert code == 0 and report["source"] == "cache", report
    reply = query(daemon.socket, "release")
    assert reply["ok"] is False and reply["error"] == "busy"
    assert query(daemon.socket, "get_memory")["bytes"] == daemon.info["bytes"]
