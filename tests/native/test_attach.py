"""Attach like a restarting engine: real daemon processes, real sockets, bytes compared."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import struct
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from weightcache.native.engine import attach as client
from weightcache.native.engine.attach import (
    DeviceMismatchError,
    FingerprintMismatchError,
    NotReadyError,
    attach,
    load_state_dict,
    materialize,
    query,
)
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.checkpoints import TINY

from .conftest import copy_checkpoint, private_dir

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def reference(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as safetensors itself reads it."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_matches(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ref) <= set(state)
    for name, tensor in ref.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def test_zero_copy_attach_matches_checkpoint(served, ckpt):
    sockets, ready = served
    res = attach(ckpt, socket_dir=sockets, mode="zero_copy", fallback=False)
    assert res.source == "cache" and res.reason is None
    assert res.socket == str(socket_path(sockets, cpu_identity(0)))
    ref = reference(ckpt)
    assert_matches(res.state_dict, ref)
    assert res.tensors == len(ref) and res.nbytes == ready["bytes"]
    # Tied: served once, one tensor object under both names.
    assert HEAD not in ref and res.state_dict[HEAD] is res.state_dict[EMBED]
    # Zero copy: all tensors are views of one mapping, at aligned offsets.
    ptrs = sorted(t.data_ptr() for t in res.state_dict.values())
    assert ptrs[-1] - ptrs[0] < ready["bytes"]
    assert all(p % 256 == ptrs[0] % 256 for p in ptrs)
    # A stray write by one engine stays private to it (MAP_PRIVATE over a sealed memfd).
    res.state_dict["model.norm.weight"].fill_(7)
    again = attach(ckpt, socket_dir=sockets, fallback=False).state_dict
    assert torch.equal(again["model.norm.weight"], ref["model.norm.weight"])


class Layer(nn.Module):
    def __init__(self, hidden: int, kv: int, inter: int) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
            setattr(self.self_attn, name, nn.Linear(hidden, out, bias=False))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.input_layernorm = nn.LayerNorm(hidden, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(hidden, bias=False)


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        s = TINY
        kv = s.kv_heads * (s.hidden // s.heads)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList(
            Layer(s.hidden, kv, s.intermediate) for _ in range(s.layers)
        )
        self.model.norm = nn.LayerNorm(s.hidden, bias=False)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied


def _sockets_open() -> int:
    """Unix and other sockets this test process holds open (its /proc fd links)."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += (fds / fd.name).readlink().name.startswith("socket:")
        except OSError:
            continue
    return count


def test_the_hello_goes_before_the_plan_and_no_connection_outlives_an_attach(
        ckpt, sock_dir, preload, monkeypatch):
    """The daemon's hello is sent before the plan (`_Hello`); whatever the attach then does
    (serves, fails its plan, or finds the early connection too old to use), it leaves no
    connection open, and a too-old one is replaced by a fresh one, still from the cache.
    A daemon of its own: the shared one's request counts are other tests' to assert on."""
    preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir)).wait_ready(120)
    sockets = sock_dir
    ref = reference(ckpt)
    attach(ckpt, socket_dir=sockets, fallback=False)  # lazy imports, the plan kept
    before = _sockets_open()
    for mode in ("zero_copy", "copy"):
        res = attach(ckpt, socket_dir=sockets, mode=mode, fallback=False)
        assert res.source == "cache"
        assert_matches(res.state_dict, ref)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)  # a socket left to the collector
        with pytest.raises(ValueError, match="REGEX=DIM"):  # a bad rule: refused planning
            attach(ckpt, socket_dir=sockets, shard_rules=["nodim"], fallback=False)
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]
    assert _sockets_open() == before
    monkeypatch.setattr(client, "REQUEST_DEADLINE_S", 0.0)  # every early hello is too old
    res = attach(ckpt, socket_dir=sockets, mode="copy", fallback=False)
    assert res.source == "cache"
    assert_matches(res.state_dict, ref)
    assert _sockets_open() == before


def test_materialize_keeps_tied_weights_tied(served, ckpt):
    sockets, _ = served
    with torch.device("meta"):
        model = TinyLlama()
    state = load_state_dict(ckpt, socket_dir=sockets, fallback=False)
    materialize(model, state)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == state[EMBED].data_ptr()
    assert not any(p.is_meta for p in model.parameters())
    ref = reference(ckpt)
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, ref[down])
    # The module runs on the mapped weights.
    logits = model.lm_head(model.model.embed_tokens(torch.tensor([[1, 2, 3]])))
    assert logits.shape == (1, 3, TINY.vocab)


def test_materialize_reports_missing_tensors(served, ckpt):
    sockets, _ = served
    with torch.device("meta"):
        model = TinyLlama()
        model.extra = nn.Linear(2, 2)
    state = load_state_dict(ckpt, socket_dir=sockets, fallback=False)
    with pytest.raises(client.MissingTensorError, match="extra"):
        materialize(model, state)


def test_copy_mode_clones_and_leaves_the_cache_for_later_engines(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    ready = p.wait_ready(120)
    sock = ready["sockets"][0]
    res = attach(ckpt, socket_dir=sock_dir, mode="copy", fallback=False)
    assert res.source == "cache" and res.mode == "copy"
    assert_matches(res.state_dict, reference(ckpt))
    assert res.state_dict[HEAD] is res.state_dict[EMBED]
    # One engine's copy does not empty the cache for the next one.
    assert query(sock, "get_memory")["bytes"] == ready["bytes"]
    assert attach(ckpt, socket_dir=sock_dir, fallback=False).source == "cache"


def _arena_maps() -> int:
    """Mappings of a daemon's memfd arena in this process (/proc/self/maps)."""
    return Path("/proc/self/maps").read_text().count("weightcache-arena")


def test_copy_mode_asks_for_its_block_ahead_and_unmaps_on_its_thread(
        tmp_path, sock_dir, preload, monkeypatch):
    """With a kept plan, copy mode asks for its block before the plan is checked, by the kept
    plan's size, and unmaps the arena on the process's copy-mode thread once the copy is
    done: the bytes are the checkpoint's, and once that thread is idle no mapping is left.
    A checkpoint rewritten since at another size: the block asked for ahead does not fit and
    one of the right size serves the new bytes (from a daemon of the new files; from disk
    where the daemon of the old ones refuses them)."""
    from weightcache.native.engine import plancache
    from weightcache.testing.checkpoints import write_llama_checkpoint

    monkeypatch.setattr(plancache, "RACY_S", 0.0)  # files written just now may be kept
    model = write_llama_checkpoint(tmp_path / "m", TINY, files=2, seed=3)
    preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir)).wait_ready(120)
    first = attach(model, socket_dir=sock_dir, mode="copy", fallback=False)
    assert first.source == "cache"
    kept = client.PLANS.peek(client._plan_key(model, 1, 0, None, "auto"))
    assert kept is not None and kept.layout.nbytes == first.nbytes
    assert client._Allocator.settle(10)
    before = _arena_maps()
    res = attach(model, socket_dir=sock_dir, mode="copy", fallback=False)
    assert res.source == "cache" and res.plan == "kept"
    assert_matches(res.state_dict, reference(model))
    assert "weightcache-alloc" in {t.name for t in threading.enumerate()}
    assert client._Allocator.settle(10)
    gc.collect()
    assert _arena_maps() == before  # this attach's mapping is gone

    bigger = dataclasses.replace(TINY, intermediate=TINY.intermediate * 2)
    write_llama_checkpoint(model, bigger, files=2, seed=4)
    assert client.PLANS.peek(client._plan_key(model, 1, 0, None, "auto")) is kept
    moved = attach(model, socket_dir=sock_dir, mode="copy", fallback=True)
    assert moved.source == "disk" and moved.reason.startswith("fingerprint_mismatch")
    assert moved.nbytes > first.nbytes
    assert_matches(moved.state_dict, reference(model))
    client.PLANS.put(client._plan_key(model, 1, 0, None, "auto"), kept, time.time_ns())
    other = private_dir(tmp_path / "other")
    preload("--model", str(model), "--weight-cache-socket-dir", str(other)).wait_ready(120)
    served = attach(model, socket_dir=other, mode="copy", fallback=False)
    assert served.source == "cache" and served.nbytes > first.nbytes
    assert_matches(served.state_dict, reference(model))


def test_release_reports_what_zero_copy_engines_still_map(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    ready = p.wait_ready(120)
    sock = ready["sockets"][0]
    held = attach(ckpt, socket_dir=sock_dir, fallback=False)  # zero_copy: maps the arena
    released = query(sock, "release")
    assert released["released"] == ready["bytes"]
    # The engine's mapping keeps the pages: the daemon does not claim they were freed.
    assert released["still_mapped"] == ready["bytes"] and released["freed"] is False
    memory = query(sock, "get_memory")
    assert memory["bytes"] == 0 and memory["mapped_after_release"] == ready["bytes"]
    assert query(sock, "hello")["ready"] is False
    assert_matches(held.state_dict, reference(ckpt))  # still readable after release
    with pytest.raises(NotReadyError):
        attach(ckpt, socket_dir=sock_dir, fallback=False)
    fell_back = attach(ckpt, socket_dir=sock_dir, fallback=True)
    assert fell_back.source == "disk" and fell_back.reason.startswith("not_ready")
    assert_matches(fell_back.state_dict, reference(ckpt))


def test_tp2_shards_match_a_manual_split(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--tensor-parallel-size", "2", "--dtype", "float32",
                "--weight-cache-socket-dir", str(sock_dir))
    ready = p.wait_ready(120)
    assert ready["ranks"] == 2 and len(set(ready["sockets"])) == 2
    ref = {k: v.float() for k, v in reference(ckpt).items()}  # bf16 -> fp32 is exact
    dims = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
            "o_proj": 1, "down_proj": 1, "embed_tokens": 0}
    for rank in (0, 1):
        res = attach(ckpt, tp_size=2, tp_rank=rank, socket_dir=sock_dir, fallback=False,
                     dtype="float32")
        assert res.source == "cache"
        for name, full in ref.items():
            dim = next((d for key, d in dims.items() if f"{key}.weight" in name), None)
            want = full if dim is None else torch.chunk(full, 2, dim=dim)[rank]
            assert torch.equal(res.state_dict[name], want), (rank, name)
        assert res.state_dict[HEAD] is res.state_dict[EMBED]
        # The daemon and the disk path agree on the layout too.
        disk = attach(ckpt, tp_size=2, tp_rank=rank, socket_dir=sock_dir / "none",
                      dtype="float32")
        assert disk.source == "disk"
        assert_matches(res.state_dict, disk.state_dict)
    # Rank 1 asking rank 0's socket is refused (the fingerprint carries the rank).
    with pytest.raises(FingerprintMismatchError) as info:
        attach(ckpt, tp_size=2, tp_rank=1, socket_path=ready["sockets"][0], fallback=False,
               device_index=0, dtype="float32")
    assert "tp_rank" in info.value.fields
    # Copy mode with a kept plan (rank 1's, from the loop) sends get_state right behind the
    # hello: the hello's refusal (rank 1's device is not rank 0's) is what the engine sees,
    # the daemon answered the state too (refused: the claim names rank 1), its reply went
    # unread with the connection, and the daemon serves the next copy as before.
    before = query(ready["sockets"][0], "stats")["requests"]["get_state"]
    with pytest.raises(DeviceMismatchError):
        attach(ckpt, tp_size=2, tp_rank=1, socket_path=ready["sockets"][0], fallback=False,
               device_index=1, dtype="float32", mode="copy")
    # The daemon's thread for that connection answers the state on its own time (the engine
    # did not wait for it): give it that time.
    deadline = time.monotonic() + 10
    while True:
        after = query(ready["sockets"][0], "stats")["requests"]["get_state"]
        if sum(after.values()) > sum(before.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert sum(after.values()) == sum(before.values()) + 1
    assert after.get("ok", 0) == before.get("ok", 0)
    copied = attach(ckpt, tp_size=2, tp_rank=0, socket_dir=sock_dir, fallback=False,
                    dtype="float32", mode="copy")
    assert copied.source == "cache" and copied.mode == "copy"
    # At TP=2 the shard rules decide the bytes: other rules are a mismatch.
    with pytest.raises(FingerprintMismatchError) as info:
        attach(ckpt, tp_size=2, tp_rank=0, socket_path=ready["sockets"][0], fallback=False,
               device_index=0, dtype="float32", shard_rules=[r"proj=0"])
    assert info.value.fields == ["shard_rules"]


def test_fingerprint_mismatch_falls_back_or_raises(served, ckpt, caplog):
    sockets, ready = served
    with pytest.raises(FingerprintMismatchError) as info:
        attach(ckpt, socket_dir=sockets, dtype="float32", fallback=False)
    assert info.value.fields == ["dtype"]
    # At TP=1 no rule changes a byte, so other rules (or none) still attach from the cache.
    for rules in ([r"proj=0"], []):
        same = attach(ckpt, socket_dir=sockets, shard_rules=rules, fallback=False)
        assert same.source == "cache"
    with caplog.at_level(logging.WARNING, logger="weightcache.client"):
        res = attach(ckpt, socket_dir=sockets, dtype="float32", fallback=True)
    assert res.source == "disk" and "fingerprint_mismatch" in res.reason and "dtype" in res.reason
    assert "from disk" in caplog.text and "dtype" in caplog.text
    assert res.state_dict[EMBED].dtype == torch.float32
    stats = query(ready["sockets"][0], "stats")
    assert stats["mismatches"]["dtype"] >= 2
    assert stats["requests"]["get_state"]["fingerprint_mismatch"] >= 2


def test_same_weights_in_another_directory_match(served, ckpt, tmp_path):
    sockets, _ = served
    other = copy_checkpoint(ckpt, tmp_path / "elsewhere")
    assert attach(other, socket_dir=sockets, fallback=False).source == "cache"
    # Untying the embeddings changes what is served: the alias table differs.
    cfg = json.loads((other / "config.json").read_text())
    assert cfg["tie_word_embeddings"]
    (other / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(FingerprintMismatchError) as info:
        attach(other, socket_dir=sockets, fallback=False)
    assert info.value.fields == ["aliases"]


def test_environment_fills_unset_arguments(served, ckpt, monkeypatch):
    sockets, _ = served
    monkeypatch.setenv("WEIGHTCACHE_SOCKET_DIR", str(sockets))
    monkeypatch.setenv("WEIGHTCACHE_FALLBACK", "false")
    monkeypatch.setenv("WEIGHTCACHE_MODE", "zero_copy")
    assert attach(ckpt).source == "cache"
    monkeypatch.setenv("WEIGHTCACHE_SOCKET_DIR", str(sockets / "missing"))
    with pytest.raises(client.DaemonUnavailableError):
        attach(ckpt)
    # Explicit arguments win over the environment.
    assert attach(ckpt, socket_dir=sockets).source == "cache"
    assert attach(ckpt, fallback=True).source == "disk"
    monkeypatch.setenv("WEIGHTCACHE_FALLBACK", "maybe")
    with pytest.raises(ValueError, match="WEIGHTCACHE_FALLBACK"):
        attach(ckpt)


def test_attach_cli_prints_one_json_line(served, ckpt, tmp_path):
    sockets, _ = served
    cmd = [sys.executable, "-m", "weightcache.cli", "attach", "--model", str(ckpt)]
    out = subprocess.run([*cmd, "--weight-cache-socket-dir", str(sockets), "--verify-bytes"],
                         capture_output=True, text=True, check=True)
    line = json.loads(out.stdout.strip())
    assert line["source"] == "cache" and line["reason"] is None and line["verified"] is True
    assert line["tensors"] == len(reference(ckpt)) and line["bytes"] > 0 and line["seconds"] > 0
    empty = private_dir(tmp_path / "empty")
    out = subprocess.run([*cmd, "--weight-cache-socket-dir", str(empty), "--no-fallback"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and json.loads(out.stdout)["error"] == "unavailable"


def test_concurrent_engines_attach_at_once(served, ckpt):
    sockets, ready = served
    ref = reference(ckpt)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda _: attach(ckpt, socket_dir=sockets, fallback=False), range(16)))
    for res in results:
        assert res.source == "cache"
        assert torch.equal(res.state_dict[EMBED], ref[EMBED])
    stats = query(ready["sockets"][0], "stats")
    assert stats["attach_seconds"]["count"] >= 16


def test_unusual_tensors_round_trip_through_the_layout(tmp_path):
    """Scalars, empty tensors, odd sizes, integer/bool/fp8 dtypes: views land where they should."""
    from safetensors.torch import save_file

    from weightcache.native.shared.checkpoint import open_checkpoint
    from weightcache.native.shared.loader import load_into_arena, plan_layout, tensors_from_table
    from weightcache.native.shared.sharding import parse_rules

    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "odd": torch.arange(7, dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64) * 10**12,
        "fp8": torch.randn(3, 5).to(torch.float8_e4m3fn),
        "w.q_proj.weight": torch.randn(6, 3, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=2, tp_rank=1)
    assert all(e.offset % 256 == 0 for e in layout.entries)
    flat = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    load_into_arena(layout, flat)
    got = tensors_from_table(flat, layout.table())
    for name, want in tensors.items():
        if name == "w.q_proj.weight":
            want = want[3:]
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        raw = got[name].reshape(-1).view(torch.uint8)
        assert torch.equal(raw, want.contiguous().reshape(-1).view(torch.uint8)), name


def test_the_fingerprint_names_the_served_dtype_not_the_requested_one(served, ckpt):
    """`auto` and an explicit dtype equal to the checkpoint's serve the same bytes (a hit);
    another dtype is a miss that says what each side serves."""
    sockets, _ = served
    same = attach(ckpt, socket_dir=sockets, dtype="bfloat16", fallback=False)
    assert same.source == "cache"
    assert all(t.dtype == torch.bfloat16 for t in same.state_dict.values())
    with pytest.raises(FingerprintMismatchError) as info:
        attach(ckpt, socket_dir=sockets, dtype="float16", fallback=False)
    assert info.value.fields == ["dtype"]
    assert "the cache serves bfloat16, this load asks for float16" in str(info.value)


def test_a_mixed_dtype_checkpoint_served_as_stored(preload, sock_dir, tmp_path):
    """`auto` on bf16 weights with f32 norms serves each tensor as stored: only a request
    that serves the same mix (auto) matches; bfloat16 or float32 would convert some bytes."""
    from safetensors.torch import save_file

    model = tmp_path / "mixed"
    model.mkdir()
    gen = torch.Generator().manual_seed(7)
    save_file({"w": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
               "norm": torch.randn(8, generator=gen), "ids": torch.arange(4)},
              str(model / "model.safetensors"))
    preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir)).wait_ready(120)
    hit = attach(model, socket_dir=sock_dir, fallback=False)
    assert hit.source == "cache"
    assert (hit.state_dict["w"].dtype, hit.state_dict["norm"].dtype) == (torch.bfloat16,
                                                                         torch.float32)
    for dtype in ("bfloat16", "float32"):
        with pytest.raises(FingerprintMismatchError) as info:
            attach(model, socket_dir=sock_dir, dtype=dtype, fallback=False)
        assert info.value.fields == ["dtype"]
        assert f"serves BF16:bfloat16,F32:float32, this load asks for {dtype}" in str(info.value)


FALLBACK_UNDER_RLIMIT = r"""
import json, resource, sys
import torch
from weightcache import client
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
limit = vm * 1024 + 256 * 2**20  # what is mapped now + 256 MiB: the 2 GiB arena cannot fit
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    client.attach(sys.argv[1], socket_dir=sys.argv[2], fallback=True)
except Exception as exc:
    fallback = isinstance(exc, getattr(client, "DiskFallbackError", ()))
    print(json.dumps({"type": type(exc).__name__, "fallback": fallback,
                      "reason": getattr(exc, "reason", None),
                      "cache_reason": getattr(exc, "cache_reason", None),
                      "cause": type(exc.__cause__).__name__, "message": str(exc)}))
"""


def test_a_failing_disk_fallback_raises_one_documented_error(tmp_path, sock_dir):
    """No daemon (the cache says `unavailable`), then the disk path runs out of address space
    (a real RLIMIT_AS in a child): a DiskFallbackError, the torch error as its cause and the
    cache's reason kept; not torch's RuntimeError."""
    model = tmp_path / "big"
    model.mkdir()
    nbytes = 2 * 2**30
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    header += " " * (-len(header) % 8)
    with open(model / "model.safetensors", "wb") as fh:  # sparse: no disk for the data
        fh.write(struct.pack("<Q", len(header)) + header.encode())
        fh.truncate(8 + len(header) + nbytes)
    out = subprocess.run([sys.executable, "-P", "-c", FALLBACK_UNDER_RLIMIT, str(model),
                          str(sock_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["fallback"] and got["reason"] == "disk_fallback", got
    assert got["cache_reason"].startswith("unavailable: "), got
    assert got["cause"] in ("RuntimeError", "MemoryError", "OSError"), got
    assert "from the cache (unavailable: " in got["message"] and "nor from disk" in got["message"]
