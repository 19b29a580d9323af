"""In-place updates on a real GPU (marked `gpu`): both CUDA transports, a captured CUDA graph.

The engine (docs/examples/live_update.py) captures one CUDA graph over weights mapped from the
daemon; after `weightcache update` the same graph, replayed, gives the new checkpoint's
outputs. Device memory is read with cudaMemGetInfo around the update: it must not grow (the
new bytes are written into the existing allocation; staging is pinned host memory).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from weightcache.client import attach, follow_updates
from weightcache.native.coordinator import update_group

from .conftest import write_checkpoint

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "live_update.py"
DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("upd")
    return (write_checkpoint(root / "a", hidden=1024, seed=0),
            write_checkpoint(root / "b", hidden=1024, seed=1))


@pytest.mark.parametrize("transport", ["cuda_vmm", "cuda_ipc"])
def test_cuda_graph_replays_new_weights_without_recapture(models, daemon_factory, transport):
    a, b = models
    d = daemon_factory(a, transport)
    out = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(a), "--new-model", str(b),
                          "--socket-dir", str(d.socket_dir), "--device", "cuda"],
                         capture_output=True, text=True, check=False, timeout=300)
    print(out.stdout, out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, report
    assert report["graph"] and report["addresses_kept"] and report["outputs_changed"]
    assert report["equals_new_model"]


@pytest.mark.parametrize("transport", ["cuda_vmm", "cuda_ipc"])
def test_update_adds_no_device_memory_and_keeps_pointers(models, daemon_factory, transport):
    a, b = models
    d = daemon_factory(a, transport)
    res = attach(a, device=DEV, socket_path=d.socket, fallback=False)
    assert res.source == "cache"
    ptrs = {n: t.data_ptr() for n, t in res.state_dict.items()}
    part = follow_updates(res)
    torch.cuda.synchronize(DEV)
    free_before = torch.cuda.mem_get_info(DEV)[0]
    low = [free_before]
    done = threading.Event()

    def sample() -> None:  # lowest free device memory while the update runs
        while not done.is_set():
            low.append(torch.cuda.mem_get_info(DEV)[0])
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = update_group([Path(d.socket)], model=str(b))
    finally:
        done.set()
        sampler.join()
        part.close()
    free_after = torch.cuda.mem_get_info(DEV)[0]
    print(json.dumps({"transport": transport, **result, "free_before": free_before,
                      "free_min": min(low), "free_after": free_after}))
    assert result["generation"] == 2 and result["engines_paused"] == 1
    assert result["stage_phases"]["staging"] == "files"  # b's own pinned pages, no host copy
    assert {n: t.data_ptr() for n, t in res.state_dict.items()} == ptrs
    ref = {}
    from safetensors.torch import load_file
    for f in sorted(b.glob("*.safetensors")):
        ref.update(load_file(str(f), device="cuda:0"))
    for name, tensor in ref.items():
        assert torch.equal(res.state_dict[name], tensor), name
    # 0 bytes more on the device, within the 2 MiB granularity of the driver's own bookkeeping.
    assert free_before - min(low) <= 2 << 20
    assert free_before - free_after <= 2 << 20


def _on_device(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ref: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        ref.update(load_file(str(f), device="cuda:0"))
    return ref


@pytest.mark.parametrize(("transport", "staging"), [
    ("cuda_vmm", "auto"), ("cuda_ipc", "auto"), ("cuda_vmm", "host"), ("cuda_ipc", "host")])
def test_write_then_rollback_restores_bytes_at_the_same_addresses(models, daemon_factory,
                                                                   transport, staging,
                                                                   monkeypatch):
    """The rollback path on a CUDA arena: stage keeps revision A (its files' pinned pages,
    or with `WEIGHTCACHE_UPDATE_STAGING=host` a pinned host copy made device-to-host), the
    write puts B into the arena, the abort writes A back (host-to-device into the same
    allocation); the engine resumes unchanged. The CPU twin is
    tests/native/test_update.py::test_abort_after_write_rolls_back_at_the_same_addresses
    (same daemon code, memfd arena)."""
    from weightcache.native.coordinator import GroupUpdate

    a, b = models
    monkeypatch.setenv("WEIGHTCACHE_UPDATE_STAGING", staging)  # the daemon inherits it
    d = daemon_factory(a, transport)
    res = attach(a, device=DEV, socket_path=d.socket, fallback=False)
    assert res.source == "cache"
    ptrs = {n: t.data_ptr() for n, t in res.state_dict.items()}
    resumed: list[tuple[int, bool]] = []
    part = follow_updates(res, on_resume=lambda g, c: resumed.append((g, c)))
    torch.cuda.synchronize(DEV)
    free_before = torch.cuda.mem_get_info(DEV)[0]
    group = GroupUpdate([Path(d.socket)])
    try:
        report = group.prepare(model=str(b))
        assert report["rollback"] is True, report
        kind = "files" if staging == "auto" else "host"
        assert report["stage_phases"]["staging"] == kind, report
        assert report["stage_phases"]["rollback_source"] == (
            "files" if staging == "auto" else "device"), report
        group.pause()
        group.write()
        torch.cuda.synchronize(DEV)
        for name, tensor in _on_device(b).items():  # written, not finished
            assert torch.equal(res.state_dict[name], tensor), name
        assert group.abort() is True and group.report["rolled_back"] is True
        assert part.wait_for("resumed")
    finally:
        group.close()
        part.close()
    torch.cuda.synchronize(DEV)
    free_after = torch.cuda.mem_get_info(DEV)[0]
    print(json.dumps({"transport": transport, "free_before": free_before,
                      "free_after": free_after}))
    assert resumed == [(1, False)]
    assert {n: t.data_ptr() for n, t in res.state_dict.items()} == ptrs
    for name, tensor in _on_device(a).items():
        assert torch.equal(res.state_dict[name], tensor), name
    assert free_before - free_after <= 2 << 20  # the copy lives in host memory
    again = attach(a, device=DEV, socket_path=d.socket, fallback=False)
    assert again.source == "cache" and again.generation == 1


@pytest.mark.parametrize(("tp_size", "tp_rank", "pin"), [
    (1, 0, "now"), (2, 0, "now"), (2, 1, "now"), (2, 1, "later"), (2, 1, "refused")])
def test_file_image_writes_the_loaders_bytes_on_the_device(models, tp_size, tp_rank, pin,
                                                           monkeypatch):
    """The CUDA side of staging from the files' pages (daemon/staging.py): every file pinned
    read-only, whole tensors and row splits copied as ranges, column splits as 2-D copies;
    the arena must equal the loader's, byte for byte. `later` is a rollback source's image:
    mapped at the stage, registered by its write; `refused`: the driver refuses that late
    registration, and the write goes through host memory of ours. CPU twin:
    tests/native/test_staging.py."""
    from weightcache.native.daemon import staging
    from weightcache.native.shared.checkpoint import open_checkpoint
    from weightcache.native.shared.loader import load_into_arena
    from weightcache.native.shared.rankplan import plan_rank_shard
    from weightcache.native.shared.sharding import parse_rules

    ckpt = open_checkpoint(models[1])
    layout, _ = plan_rank_shard(ckpt, parse_rules(None), tp_size=tp_size, tp_rank=tp_rank,
                                dtype="auto")
    expected = torch.zeros(layout.nbytes, dtype=torch.uint8)
    load_into_arena(layout, expected, digest=list(ckpt.files), share=tp_size > 1)
    image, _ = staging.file_image(layout, list(ckpt.files), DEV, share=tp_size > 1,
                                  pin_later=pin != "now")
    try:
        assert all(f.registered == (pin == "now") and f.addr for f in image.files.values()
                   if f.size)
        if tp_size > 1:
            assert any(r.height > 1 for r in image.runs)
        if pin == "refused":
            def refuse(f, ordinal):
                raise staging.ImageRefused(f"the driver would not pin {f.path} (test)")
            monkeypatch.setattr(staging, "_register", refuse)
        got = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
        image.write_into(got)
        if pin == "later":
            assert all(f.registered for f in image.files.values() if f.size)
            assert image.pin_seconds > 0
        if pin == "refused":
            assert not any(f.registered for f in image.files.values())
        host = got.cpu()
        for e in layout.entries:
            assert torch.equal(host[e.offset: e.offset + e.nbytes],
                               expected[e.offset: e.offset + e.nbytes]), e.name
    finally:
        image.close()
    assert not any(f.registered or f.addr for f in image.files.values())
