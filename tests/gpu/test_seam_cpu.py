"""CPU coverage of the CUDA side of the transport seam: runs everywhere, needs no GPU.

GPU identity normalisation, the registry's behaviour with CUDA transports present but unusable,
the legacy-IPC preflight errors, lazy imports without cuda-python, and the cold loader's
planning and copying (its CPU path runs the same job plan as the CUDA one).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightcache.native.shared import coldload, content, gpu
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.loader import plan_layout
from weightcache.native.shared.sharding import parse_rules
from weightcache.native.shared.transport import (
    TransportError,
    TransportUnavailableError,
    available_transports,
    default_transport,
    get_transport,
)
from weightcache.testing.processes import run_without_cuda_python

UUID = "GPU-4f1e2a3b-1c2d-3e4f-5a6b-7c8d9e0f1a2b"


def test_normalize_uuid_forms():
    assert gpu.normalize_uuid("GPU-" + UUID[4:].upper()) == UUID
    assert gpu.normalize_uuid(UUID[4:]) == UUID
    assert gpu.normalize_uuid(UUID[4:].replace("-", "")) == UUID
    assert gpu.uuid_from_bytes(bytes.fromhex(UUID[4:].replace("-", ""))) == UUID
    with pytest.raises(gpu.GpuError):
        gpu.normalize_uuid("GPU-nothex")
    with pytest.raises(gpu.GpuError):
        gpu.uuid_from_bytes(b"\x00" * 15)


def test_canonical_identity_is_what_the_daemons_name_sockets_by():
    # nvidia-smi and NVIDIA_VISIBLE_DEVICES list `GPU-<uuid>` (or `MIG-...` for MIG instances).
    assert gpu.canonical_identity("GPU-" + UUID[4:].upper()) == UUID
    assert gpu.canonical_identity(" " + UUID) == UUID
    assert gpu.canonical_identity("MIG-4f1e2a3b-1c2d") == "MIG-4f1e2a3b-1c2d"
    assert gpu.canonical_identity("0") is None
    assert gpu.canonical_identity("GPU-nothex") is None


def test_cuda_transports_registered_but_unavailable_on_cpu():
    cpu = torch.device("cpu")
    assert default_transport(cpu).name == "memfd"
    assert "cuda_vmm" not in available_transports(cpu)
    for name in ("cuda_vmm", "cuda_ipc"):
        try:
            transport = get_transport(name)
        except TransportUnavailableError:
            continue  # an install without the module at all is fine too
        assert transport.name == name
        assert transport.available(cpu) is False
        if not torch.cuda.is_available():
            assert transport.available(torch.device("cuda", 0)) is False
        with pytest.raises(TransportUnavailableError):
            transport.allocate(1 << 20, cpu)


@pytest.mark.parametrize("name", ["cuda_vmm", "cuda_ipc"])
def test_attach_never_leaks_fds_it_was_given(name):
    transport = get_transport(name)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(TransportError):
        transport.attach({"transport": name, "nbytes": 1}, [r], torch.device("cpu"))
    with pytest.raises(OSError):
        os.fstat(r)


def test_ipc_preflight_names_the_isolation_problem(monkeypatch):
    from weightcache.native.shared.transport import cuda_ipc

    with pytest.raises(cuda_ipc.IpcIsolationError, match=r"PID .* equals .*cuda_vmm"):
        cuda_ipc.preflight({"pid": os.getpid()})
    cuda_ipc.preflight({"pid": os.getpid() + 1})
    monkeypatch.setenv(cuda_ipc.ENV_PREFLIGHT, "0")
    cuda_ipc.preflight({"pid": os.getpid()})


def test_ipc_handle_round_trips_through_hex():
    pytest.importorskip("cuda.bindings.driver")
    from weightcache.native.shared.transport import cuda_ipc

    raw = bytes(range(64))
    handle = cuda_ipc._handle_from(raw)
    assert cuda_ipc._handle_bytes(handle) == raw
    with pytest.raises(TransportError):
        cuda_ipc._handle_from(b"short")


def test_transport_modules_import_without_cuda_python():
    code = textwrap.dedent(
        """
        import torch
        from weightcache.native.shared.transport import cuda_vmm, cuda_ipc, _cuda, default_transport
        assert not _cuda.bindings_importable()
        assert not cuda_vmm.TRANSPORT.available(torch.device("cuda", 0))
        assert not cuda_ipc.TRANSPORT.available(torch.device("cuda", 0))
        assert default_transport("cpu").name == "memfd"
        print("ok")
        """
    )
    out = run_without_cuda_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(7)
    shard1 = {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 48, generator=gen),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(48, 32, generator=gen).half(),
        "model.layers.0.input_layernorm.weight": torch.randn(48, generator=gen),
    }
    shard2 = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(48, 96, generator=gen).to(
            torch.bfloat16
        ),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(48, generator=gen),
        "step": torch.tensor([3, 1, 4], dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    save_file(shard1, tmp_path / "model-00001-of-00002.safetensors")
    save_file(shard2, tmp_path / "model-00002-of-00002.safetensors")
    return open_checkpoint(tmp_path)


def _reference_arena(layout) -> torch.Tensor:
    """The arena built from safetensors' own reader (independent of the loader under test)."""
    from safetensors.torch import load_file

    files = {e.source.file for e in layout.entries}
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    out = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8)
    for e in layout.entries:
        value = tensors[e.name]
        if e.spec.dim is not None:
            value = value.narrow(e.spec.dim, e.spec.start, e.spec.length)
        out[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.spec.shape).copy_(value)
    return out


@pytest.mark.parametrize(
    ("tp", "dtype", "chunk", "threads", "direct"),
    [
        (1, "auto", 4096, 3, False),
        (2, "auto", 4096, 2, True),
        (2, "float16", 8192, 4, False),
        (1, "float32", 1 << 20, 1, True),
    ],
)
def test_coldload_matches_the_reference_loader(tmp_path, tp, dtype, chunk, threads, direct):
    ckpt = _checkpoint(tmp_path)
    rules = parse_rules(None)
    for rank in range(tp):
        layout = plan_layout(ckpt, rules=rules, tp_size=tp, tp_rank=rank, dtype=dtype)
        want = _reference_arena(layout)
        got = torch.full((layout.nbytes,), 0x5A, dtype=torch.uint8)
        stats = coldload.load_entries(
            list(layout.entries), got, threads=threads, chunk=chunk, direct=direct,
            digest=list(ckpt.files),
        )
        assert stats.record == content.digest_files(ckpt.files)  # the CUDA path's hashing
        # Padding between tensors differs (poison values); every tensor's bytes must match.
        for entry in layout.entries:
            a = want[entry.offset : entry.offset + entry.nbytes]
            b = got[entry.offset : entry.offset + entry.nbytes]
            assert torch.equal(a, b), entry.name
        assert stats.nbytes == sum(e.nbytes for e in layout.entries)
        if dtype == "auto":
            assert stats.read_bytes >= stats.nbytes


def test_coldload_plan_is_sequential_and_bounded(tmp_path):
    ckpt = _checkpoint(tmp_path)
    layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=2, tp_rank=1)
    jobs = coldload.plan_jobs(list(layout.entries), 1024)
    direct = [j for j in jobs if j.entry is None]
    staged = [j for j in jobs if j.entry is not None]
    # Row-parallel weights split along dim 1 need staging; everything else is a byte range.
    assert {j.entry.name for j in staged} == {
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }
    for job in direct:
        assert job.end - job.start <= 1024
        assert sum(p.nbytes for p in job.pieces) == job.end - job.start
        pos = job.start
        for piece in job.pieces:  # pieces tile the job's file range in order
            assert piece.file_offset == pos
            pos += piece.nbytes


def test_drop_page_cache_accepts_files(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8192)
    assert coldload.drop_page_cache([path]) in {True, False}


@given(nbytes=st.integers(0, 1 << 40), gran=st.sampled_from([1 << 16, 1 << 21, 1 << 30]),
       count=st.integers(-2, 100))
def test_vmm_piece_sizes_cover_the_arena_evenly(nbytes, gran, count):
    """The pieces of an arena: whole granules, as many as asked where the arena has that many
    granules (at least one), no two differing by more than a granule, summing to the arena's
    size rounded up to a granule."""
    from weightcache.native.shared.transport.cuda_vmm import piece_sizes

    sizes = piece_sizes(nbytes, gran, count)
    units = max(1, -(-nbytes // gran))
    assert len(sizes) == max(1, min(count, units))
    assert all(s > 0 and s % gran == 0 for s in sizes)
    assert sum(sizes) == units * gran >= nbytes
    assert max(sizes) - min(sizes) <= gran


@pytest.mark.parametrize(("value", "want"), [(None, 4), ("", 4), ("1", 1), ("4", 4),
                                             ("16", 16), ("17", 16), ("1000", 16), ("0", 4),
                                             ("-3", 4), ("many", 4)])
def test_vmm_pieces_knob_is_lenient_and_bounded(monkeypatch, value, want):
    """`WEIGHTCACHE_VMM_PIECES` tunes speed only: a bad value is the default (four pieces),
    one piece stays possible, and no more pieces than one protocol frame carries fds."""
    from weightcache.native.shared.transport import cuda_vmm

    if value is None:
        monkeypatch.delenv(cuda_vmm.PIECES_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_vmm.PIECES_ENV, value)
    assert cuda_vmm.pieces() == want


def test_vmm_import_refuses_pieces_that_do_not_match_their_fds():
    """The export's piece sizes are checked before any driver call: their count against the
    fds that came, each positive, their sum the arena's size, the bytes within it."""
    from weightcache.native.shared.transport.cuda_vmm import _sizes

    meta = {"nbytes": 10, "size": 12, "pieces": [4, 8]}
    assert _sizes(meta, 2) == (10, 12, [4, 8])
    assert _sizes({"nbytes": 10, "size": 12}, 1) == (10, 12, [12])  # one allocation
    for bad, nfds in ((meta, 1), ({**meta, "pieces": [4, 4]}, 2), ({**meta, "pieces": [12, 0]}, 2),
                      ({**meta, "nbytes": 13}, 2), ({**meta, "pieces": ["x", 8]}, 2),
                      ({"size": 12}, 1)):
        with pytest.raises(TransportError):
            _sizes(bad, nfds)
