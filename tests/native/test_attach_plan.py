"""The attach's fast path: a kept plan, the table digest, views, header parsing, the GC pause.

Real files and a real daemon; the plan cache is checked by what it must never do (serve a
plan of files that changed) as much as by what it saves.
"""

from __future__ import annotations

import gc
import json
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightcache.native.engine import plancache
from weightcache.native.engine.attach import attach, plan_rank, request
from weightcache.native.shared import fingerprint as fp
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.checkpoint import CheckpointError, open_checkpoint
from weightcache.native.shared.connection import connect
from weightcache.native.shared.loader import load_into_arena, plan_layout, tensors_from_table
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import TINY, write_llama_checkpoint

CPU = torch.device("cpu")


def _plan(model: Path, **kw):
    return plan_rank(model, device=CPU, device_index=0, tp_size=1, tp_rank=0,
                     shard_rules=None, dtype="auto", **kw)


def _files(model: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _settle(seconds: float) -> None:
    time.sleep(seconds + 0.05)  # what was just written is older than the racy window now


@pytest.fixture
def short_racy(monkeypatch):
    monkeypatch.setattr(plancache, "RACY_S", 0.2)
    yield 0.2


def test_a_kept_plan_is_used_until_any_file_changes(tmp_path, short_racy):
    model = write_llama_checkpoint(tmp_path / "m", TINY, files=2, seed=0)
    _settle(short_racy)
    first = _plan(model)
    again = _plan(model)
    assert first.planned and not again.planned and again.layout is first.layout
    assert again.fingerprint["content"] is not first.fingerprint["content"]  # claimed anew
    assert {k: v for k, v in again.fingerprint.items() if k != "content"} == \
        {k: v for k, v in first.fingerprint.items() if k != "content"}
    assert _plan(model, cache=False).planned

    # Rewritten in place with other values, same names and shapes: never the old plan.
    write_llama_checkpoint(model, TINY, files=2, seed=1)
    res = attach(model, socket_path=tmp_path / "none.sock", fallback=True)
    assert res.source == "disk"
    for name, want in _files(model).items():
        assert torch.equal(res.state_dict[name], want), name
    assert _plan(model).planned  # written just now: used, not kept

    _settle(short_racy)
    assert _plan(model).planned and not _plan(model).planned
    cfg = json.loads((model / "config.json").read_text())
    cfg["tie_word_embeddings"] = not cfg.get("tie_word_embeddings", False)
    (model / "config.json").write_text(json.dumps(cfg))
    changed = _plan(model)
    assert changed.planned and changed.layout.aliases != first.layout.aliases

    _settle(short_racy)
    assert _plan(model).planned and not _plan(model).planned
    (model / "extra.txt").write_text("a new directory entry")  # the directory changed
    assert _plan(model).planned

    _settle(short_racy)
    assert _plan(model).planned and not _plan(model).planned
    victim = sorted(model.glob("*.safetensors"))[0]
    victim.rename(tmp_path / "gone.safetensors")
    with pytest.raises(CheckpointError):
        _plan(model)


def test_a_peeked_plan_is_a_guess_and_never_served(tmp_path, short_racy):
    """`PlanCache.peek` (the size copy mode starts allocating before the plan is checked)
    gives the kept plan unchecked; the plan an attach serves by is still checked."""
    from weightcache.native.engine.attach import PLANS, _plan_key

    model = write_llama_checkpoint(tmp_path / "m", TINY, files=2, seed=0)
    _settle(short_racy)
    key = _plan_key(model, 1, 0, None, "auto")
    assert PLANS.peek(key) is None
    first = _plan(model)
    assert PLANS.peek(key).layout is first.layout
    write_llama_checkpoint(model, TINY, files=2, seed=1)
    assert PLANS.peek(key).layout is first.layout  # a guess: nothing checked
    assert _plan(model).planned  # what is served by: planned anew


def test_a_plan_of_files_written_just_now_is_not_kept(tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", TINY, files=1)
    assert _plan(model).planned and _plan(model).planned


def test_the_daemon_and_the_client_agree_on_the_digest(served, ckpt):
    _, ready = served
    plan = _plan(ckpt, cache=False)
    with connect(ready["sockets"][0]) as sock:
        reply, fds = request(sock, "get_state", accept_fds=True, fingerprint=plan.fingerprint)
        for fd in fds:
            import os

            os.close(fd)
    assert reply["ok"] and reply["table_digest"] == plan.layout.digest
    assert "tensors" not in reply  # the rows stay home


@pytest.mark.parametrize("older", [1, 2])
def test_an_older_protocol_engine_is_refused_by_the_daemon(served, ckpt, older):
    _, ready = served
    plan = _plan(ckpt, cache=False)
    old = {**plan.fingerprint, "runtime_version": fp.RUNTIME_VERSION.replace(
        f"protocol-{proto.PROTOCOL_VERSION}", f"protocol-{older}")}
    with connect(ready["sockets"][0]) as sock:
        reply, fds = request(sock, "get_state", accept_fds=True, fingerprint=old)
    assert not fds and reply["error"] == "fingerprint_mismatch"
    assert reply["fields"] == ["runtime_version"]


def test_the_table_digest_covers_every_field(ckpt):
    layout = plan_layout(open_checkpoint(ckpt), rules=parse_rules(None), tp_size=1, tp_rank=0,
                         aliases={"lm_head.weight": "model.embed_tokens.weight"})
    base = layout.digest
    e = layout.entries[3]
    changed = [
        e._replace(name=e.name + "x"),
        e._replace(dtype=torch.float16 if e.dtype != torch.float16 else torch.bfloat16),
        e._replace(spec=e.spec._replace(shape=(*e.spec.shape, 1))),
        e._replace(offset=e.offset + 256),
        e._replace(nbytes=e.nbytes + 2),
    ]
    digests = set()
    for entry in changed:
        entries = list(layout.entries)
        entries[3] = entry
        digests.add(type(layout)(entries, layout.aliases, layout.nbytes).digest)
    digests.add(type(layout)(layout.entries[:-1], layout.aliases, layout.nbytes).digest)
    digests.add(type(layout)(layout.entries, {}, layout.nbytes).digest)
    digests.add(type(layout)(layout.entries, layout.aliases, layout.nbytes + 256).digest)
    assert base not in digests and len(digests) == 8


def test_views_equal_the_checked_table(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "odd": torch.arange(7, dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(3, 5).to(torch.float8_e4m3fn),
        "w.q_proj.weight": torch.randn(6, 3, dtype=torch.bfloat16),
        "w.k_proj.weight": torch.randn(6, 3, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layout = plan_layout(open_checkpoint(tmp_path), rules=parse_rules(None), tp_size=2,
                         tp_rank=1, aliases={"alias": "odd"})
    flat = torch.full((layout.nbytes + 3,), 0xAB, dtype=torch.uint8)
    load_into_arena(layout, flat)
    fast, checked = layout.views(flat), tensors_from_table(flat, layout.table(), layout.aliases)
    assert list(fast) == list(checked) and fast["alias"] is fast["odd"]
    for name, t in checked.items():
        f = fast[name]
        assert (f.dtype, f.shape, f.stride(), f.storage_offset()) == (
            t.dtype, t.shape, t.stride(), t.storage_offset()), name
        assert f.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(f.view(torch.uint8) if f.dim() else f.reshape(1).view(torch.uint8),
                           t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8))
    from weightcache.native.shared.loader import ArenaLayoutError

    with pytest.raises(ArenaLayoutError):
        layout.views(flat[: layout.nbytes - 1])


def _header_file(path: Path, header: dict) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)


def test_header_nesting_is_bounded_without_scanning_every_header(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    _header_file(ok / "model.safetensors", {  # brackets in names: the exact scan, accepted
        "a[0]{x}": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "__metadata__": {"format": "[pt]"}})
    assert list(open_checkpoint(ok).tensors) == ["a[0]{x}"]
    deep = tmp_path / "deep"
    deep.mkdir()
    nested: object = 1
    for _ in range(100):
        nested = [nested]
    _header_file(deep / "model.safetensors", {  # 100 deep in a key we otherwise ignore
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": nested}})
    with pytest.raises(CheckpointError, match="nested deeper than 64"):
        open_checkpoint(deep)


def test_attach_pauses_the_collector_and_restores_it(tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", TINY, files=1)
    assert gc.isenabled()
    attach(model, socket_path=tmp_path / "none.sock", fallback=True)
    assert gc.isenabled()
    gc.disable()
    try:
        attach(model, socket_path=tmp_path / "none.sock", fallback=True)
        assert not gc.isenabled()  # a process that turned it off keeps it off
    finally:
        gc.enable()
