"""The daemon's plan, shipped to an engine's first attach (plantable.py, `get_plan`).

Real daemons and real files. What must hold: the engine uses a shipped table only when it is
bound to its own files (raw headers, index, config.json, parallelism, rules, dtype), never one
a peer rewrote; it serves exactly the bytes the disk path reads; a table of any size travels
(chunks for `get_plan`, pages for `get_table`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import pytest
import torch

from weightcache.native.engine.attach import PLANS, WeightCacheError, attach
from weightcache.native.shared import plantable
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.connection import connect, request
from weightcache.native.shared.loader import plan_layout
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import write_bf16_files

from .test_robustness import LyingProxy


@pytest.fixture(autouse=True)
def no_kept_plans():
    PLANS.clear()  # every attach here is a process' first
    yield
    PLANS.clear()


def _disk(model: Path, **kw) -> dict[str, torch.Tensor]:
    res = attach(model, socket_path=model / "none.sock", fallback=True, **kw)
    assert res.source == "disk"
    PLANS.clear()
    return res.state_dict


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_first_attach_uses_the_daemons_plan_then_keeps_it(served, ckpt):
    _, ready = served
    want = _disk(ckpt)
    first = attach(ckpt, socket_path=ready["sockets"][0], fallback=False)
    assert first.source == "cache" and first.plan == "shipped" and "get_plan" in first.phases
    _same(first.state_dict, want)
    assert first.state_dict["lm_head.weight"] is first.state_dict["model.embed_tokens.weight"]
    again = attach(ckpt, socket_path=ready["sockets"][0], fallback=False)
    # Kept, unless the files were written within the racy window (plancache.py).
    assert again.plan in ("kept", "shipped")
    _same(again.state_dict, want)


def test_a_config_of_its_own_is_planned_here(served, ckpt, tmp_path):
    """Same weights, another config.json: the shipped plan is not bound to it."""
    _, ready = served
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"factor": 2.0}}))
    res = attach(copy, socket_path=ready["sockets"][0], fallback=False)
    assert res.source == "cache" and res.plan == "made"
    _same(res.state_dict, _disk(copy))
    # Untied in its config: its own plan has its own head, which the cache does not serve.
    (copy / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    PLANS.clear()
    fell = attach(copy, socket_path=ready["sockets"][0], fallback=True)
    assert fell.source == "disk" and "aliases" in fell.reason
    assert "lm_head.weight" not in fell.state_dict  # no alias, and the files hold no head


def test_tp2_ranks_get_their_own_shipped_plan(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--tensor-parallel-size", "2",
                "--weight-cache-socket-dir", str(sock_dir))
    p.wait_ready(120)
    for rank in (0, 1):
        want = _disk(ckpt, tp_size=2, tp_rank=rank)
        res = attach(ckpt, tp_size=2, tp_rank=rank, socket_dir=sock_dir, fallback=False)
        assert res.source == "cache" and res.plan == "shipped"
        _same(res.state_dict, want)


def _names(n: int) -> list[tuple[str, list[int]]]:
    """n tiny tensors with DeepSeek-length names and longer: 100,000 rows of the table
    are about 26 MB of msgpack, past the 16 MiB frame."""
    pad = "x" * 180
    return [(f"model.layers.{i // 768}.mlp.experts.{i % 768 // 3}.{pad}."
             f"{('gate_proj', 'up_proj', 'down_proj')[i % 3]}.weight", [4]) for i in range(n)]


def test_a_100k_tensor_table_round_trips_through_a_real_daemon(tmp_path, sock_dir, preload):
    model = tmp_path / "experts"
    specs = _names(100_000)
    write_bf16_files(model, [specs], config={})  # holes: reads as zeros
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir))
    ready = p.wait_ready(300)
    res = attach(model, socket_dir=sock_dir, fallback=False)
    assert res.source == "cache" and res.plan == "shipped" and res.tensors == 100_000
    assert list(res.state_dict) == sorted(n for n, _ in specs)
    assert all(t.shape == (4,) and t.dtype == torch.bfloat16 for t in res.state_dict.values())
    blob_size = None
    with connect(ready["sockets"][0]) as sock:  # the rows too, in pages under the frame
        rows, start, pages = [], 0, 0
        while start is not None:
            reply, _ = request(sock, "get_table", start=start)
            assert reply["ok"] and reply["total"] == 100_000
            rows += reply["tensors"]
            start, pages = reply["next"], pages + 1
        key = res_key(model)
        reply, _ = request(sock, "get_plan", key=key, dtype="auto", offset=0)
        assert reply["ok"]
        blob_size = reply["size"]
    assert pages > 1 and [r["name"] for r in rows] == list(res.state_dict)
    assert blob_size > plantable.CHUNK  # it came in several chunks


def res_key(model: Path) -> dict:
    from weightcache.native.shared import fingerprint as fp
    from weightcache.native.shared.checkpoint import read_raw

    raw = read_raw(model)
    return plantable.plan_key(
        checkpoint=fp.raw_checkpoint_hash(raw.header_digests), index=raw.index_digest,
        config=raw.config_digest, tp_size=1, tp_rank=0, shard_rules=fp.rules_hash([], 1),
        runtime_version=fp.RUNTIME_VERSION)


# -- a peer that rewrites the shipped table -------------------------------------------------
def _retable(change):
    """A get_plan reply with its (one-chunk) table decoded, changed and re-encoded with a
    matching digest: only the engine's own checks can refuse it."""
    def mutate(cmd, r, f):
        if cmd != "get_plan" or not r.get("ok"):
            return r, f
        obj = msgpack.unpackb(r["data"], raw=False)
        change(obj)
        blob = msgpack.packb(obj, use_bin_type=True)
        return {**r, "data": blob, "size": len(blob), "digest": plantable.digest(blob)}, f
    return mutate


def _int64(values):
    from array import array

    return array("q", values).tobytes()


def _first_offset_past_the_arena(obj):
    from array import array

    offsets = array("q")
    offsets.frombytes(obj["offset"])
    offsets[0] = obj["arena"]
    obj["offset"] = offsets.tobytes()


def _swap_key(obj):
    obj["key"] = {**obj["key"], "checkpoint": "0" * 64}


TAMPERED = {
    "a flipped byte": lambda cmd, r, f: (
        {**r, "data": bytes([r["data"][0] ^ 1]) + r["data"][1:]}
        if cmd == "get_plan" and r.get("ok") else r, f),
    "a short chunk": lambda cmd, r, f: (
        {**r, "data": r["data"][:-1]} if cmd == "get_plan" and r.get("ok") else r, f),
    "made for other headers": _retable(_swap_key),
    "an offset past the arena": _retable(_first_offset_past_the_arena),
    "a misaligned offset": _retable(lambda o: o.update(offset=_int64(
        [1] + [0] * (o["count"] - 1)))),
    "a size its shape does not have": _retable(lambda o: o.update(nbytes=_int64(
        [7] * o["count"]))),
    "a name twice": _retable(lambda o: o.update(names=b"\0".join(
        [o["names"].split(b"\0")[0]] * o["count"]))),
    "an alias to nothing": _retable(lambda o: o.update(aliases={"x": "missing"})),
    "columns of other lengths": _retable(lambda o: o.update(ndim=o["ndim"][:-1])),
    "another table's digest": _retable(lambda o: o.update(table_digest="0" * 64)),
    "not msgpack": lambda cmd, r, f: (
        {**r, "data": b"\xc1" * 8, "size": 8, "digest": plantable.digest(b"\xc1" * 8)}
        if cmd == "get_plan" and r.get("ok") else r, f),
}


@pytest.mark.parametrize("how", sorted(TAMPERED))
def test_a_tampered_shipped_table_is_refused(how, served, ckpt, tmp_path):
    _, ready = served
    want = _disk(ckpt)
    proxy = LyingProxy(ready["sockets"][0], tmp_path / "liar.sock", TAMPERED[how])
    try:
        with pytest.raises(WeightCacheError):
            attach(ckpt, socket_path=proxy.path, fallback=False)
        PLANS.clear()
        res = attach(ckpt, socket_path=proxy.path, fallback=True)
        assert res.source == "disk"
        _same(res.state_dict, want)
    finally:
        proxy.close()


def test_get_plan_refuses_other_input(served, ckpt):
    _, ready = served
    key = res_key(ckpt)
    with connect(ready["sockets"][0]) as sock:
        for bad, field in (({**key, "config": "0" * 64}, "config"),
                           ({**key, "index": None}, "index"),
                           ({**key, "tp_rank": 1}, "tp_rank")):
            reply, _ = request(sock, "get_plan", key=bad, dtype="auto")
            assert reply["error"] == proto.E_FINGERPRINT_MISMATCH and reply["fields"] == [field]
        reply, _ = request(sock, "get_plan", key=key, dtype="float32")
        assert reply["error"] == proto.E_FINGERPRINT_MISMATCH and reply["fields"] == ["dtype"]
        for bad in ({**key, "extra": 1}, {k: v for k, v in key.items() if k != "index"},
                    {**key, "config": "x" * 300}, [1]):
            reply, _ = request(sock, "get_plan", key=bad, dtype="auto")
            assert reply["error"] == proto.E_BAD_REQUEST
        reply, _ = request(sock, "get_plan", key=key, dtype="bfloat16", offset=0)
        assert reply["ok"]  # an explicit dtype equal to the stored one: the same plan


def test_the_compact_table_is_the_layout(ckpt):
    ck = open_checkpoint(ckpt)
    layout = plan_layout(ck, rules=parse_rules(None), tp_size=1, tp_rank=0,
                         aliases={"lm_head.weight": "model.embed_tokens.weight"})
    key = res_key(ckpt)
    table = plantable.decode(plantable.encode(layout, key, "bfloat16", None), key)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    got, want = table.views(flat), layout.views(flat)
    assert list(got) == list(want)
    for name, view in want.items():
        other = got[name]
        assert (other.data_ptr(), other.shape, other.stride(), other.dtype) == \
            (view.data_ptr(), view.shape, view.stride(), view.dtype), name
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    assert table.digest == layout.digest and table.count == len(layout.entries)
    with pytest.raises(plantable.PlanTableError):
        plantable.decode(plantable.encode(layout, key, "bfloat16", None),
                         {**key, "tp_rank": 1})


def test_a_kept_plan_of_files_that_changed_is_never_used(tmp_path, monkeypatch):
    """A kept plan whose files changed must not shape the views (cache or disk): its fresh
    claim names other files, so it is dropped and the attach plans anew."""
    import time

    from safetensors.torch import load_file

    from weightcache.native.engine import plancache
    from weightcache.testing.checkpoints import TINY, LlamaShape, write_llama_checkpoint

    monkeypatch.setattr(plancache, "RACY_S", 0.2)
    model = write_llama_checkpoint(tmp_path / "m", TINY, files=2)
    time.sleep(0.3)
    attach(model, socket_path=tmp_path / "none.sock", fallback=True)
    assert attach(model, socket_path=tmp_path / "none.sock", fallback=True).plan == "kept"
    wider = LlamaShape(hidden=128, layers=2, intermediate=256, vocab=256, heads=4, kv_heads=2)
    write_llama_checkpoint(model, wider, files=2, seed=3)
    res = attach(model, socket_path=tmp_path / "none.sock", fallback=True)
    assert res.source == "disk" and res.plan == "made"
    want: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        want.update(load_file(str(f)))
    for name, tensor in want.items():
        assert torch.equal(res.state_dict[name], tensor), name


def test_attaches_starting_together_fetch_the_plan_once(ckpt, sock_dir, preload, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from weightcache.native.engine import plancache
    from weightcache.native.shared.connection import query

    monkeypatch.setattr(plancache, "RACY_S", 0.0)  # the session's files are seconds old
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    ready = p.wait_ready(120)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: attach(ckpt, socket_dir=sock_dir, fallback=False),
                                range(8)))
    assert all(r.source == "cache" for r in results)
    assert sorted(r.plan for r in results) == ["kept"] * 7 + ["shipped"]
    stats = query(ready["sockets"][0], "stats")
    assert stats["requests"]["get_plan"] == {"ok": 1}
    want = _disk(ckpt)
    for r in results:
        _same(r.state_dict, want)


def test_a_table_that_cannot_be_encoded_is_not_shipped(tmp_path):
    """A name holding NUL cannot go in the names blob: the daemon ships no plan (engines
    plan themselves) rather than a wrong one."""
    model = tmp_path / "nul"
    write_bf16_files(model, [[("a\0b", [2]), ("c", [2])]], config={})
    layout = plan_layout(open_checkpoint(model), rules=parse_rules(None), tp_size=1, tp_rank=0)
    assert plantable.encode(layout, res_key(model), "bfloat16", None) is None
