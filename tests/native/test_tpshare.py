"""A tensor-parallel rank's share from the headers alone (tpshare.py) is the layout's own
(`coldload.share_chunks` of `loader.plan_layout`), on random checkpoints; and the early reads of
such a rank cut exactly the fill's jobs, take only chunks no other rank reads, and give the
fill the same bytes and the same content record as a fill without them."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.native.engine.attach import query
from weightcache.native.shared import content, tpshare
from weightcache.native.shared.checkpoint import (
    DTYPES,
    Checkpoint,
    TensorInfo,
    open_checkpoint,
    tied_aliases,
)
from weightcache.native.shared.coldload import (
    drop_page_cache,
    load_entries,
    plan_jobs,
    share_chunks,
)
from weightcache.native.shared.content import CHUNK_BYTES
from weightcache.native.shared.earlyread import (
    BUDGET_ENV,
    EarlyReads,
    grid_span,
    share_spans,
    span_of,
)
from weightcache.native.shared.loader import plan_layout
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

NAMES = ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.o_proj.weight",
         "model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.up_proj.bias",
         "model.layers.{i}.input_layernorm.weight", "model.embed_tokens.weight",
         "lm_head.weight", "model.norm.weight")
TAGS = ("BF16", "F16", "F32", "F8_E4M3", "I64")


@st.composite
def checkpoints(draw: st.DrawFn) -> tuple[Checkpoint, int]:
    tp = draw(st.sampled_from((2, 4)))
    files = [Path(f"/ckpt/model-0000{i}.safetensors") for i in range(draw(st.integers(1, 3)))]
    tensors: dict[str, TensorInfo] = {}
    ends = dict.fromkeys(files, 0)
    for i in range(draw(st.integers(1, 12))):
        name = draw(st.sampled_from(NAMES)).format(i=i)
        if name in tensors:
            continue
        ndim = draw(st.integers(1, 3))
        # Every dimension a multiple of the TP size: a rule may split any of them.
        shape = tuple(tp * draw(st.integers(1, 40)) for _ in range(ndim))
        if draw(st.booleans()):
            shape = (tp * draw(st.integers(64, 700)), *shape[1:])  # some span many chunks
        tag = draw(st.sampled_from(TAGS))
        file = draw(st.sampled_from(files))
        nbytes = math.prod(shape) * DTYPES[tag][1]
        offset = ends[file] + draw(st.integers(0, 3 * CHUNK_BYTES // 2))
        ends[file] = offset + nbytes
        tensors[name] = TensorInfo(name, tag, shape, file, offset, nbytes)
    config = {"tie_word_embeddings": draw(st.booleans())}
    return Checkpoint(Path("/ckpt"), files, tensors, config=config), tp


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checkpoints(), st.sampled_from(("auto", "bfloat16", "float16", "float32")),
       st.sampled_from((None, ["up_proj.bias$=0", "(q|o)_proj=1"], [])))
def test_the_share_from_headers_is_the_layouts(found, dtype, rules_text):
    ckpt, tp = found
    rules = parse_rules(rules_text)
    for rank in range(tp):
        try:
            entries = plan_layout(ckpt, rules=rules, tp_size=tp, tp_rank=rank, dtype=dtype,
                                  aliases=tied_aliases(ckpt)).entries
        except ValueError as exc:  # a rule that does not divide: both refuse
            with pytest.raises(type(exc)):
                tpshare.rank_chunks(ckpt, rules, tp, rank, dtype)
            return
        want = {p: c for p, c in share_chunks(entries).items() if c}
        mine, own = tpshare.own_chunks(ckpt, rules, tp, rank, dtype)
        assert mine == want
        for other in range(tp):
            if other != rank:
                theirs = tpshare.rank_chunks(ckpt, rules, tp, other, dtype)
                assert not any(own.get(p, set()) & c for p, c in theirs.items())
        assert all(own[p] <= mine[p] for p in own)


# -- the early reads of a tensor-parallel rank, against its fill ------------------------------
SHAPE = LlamaShape(hidden=1024, layers=2, intermediate=4096, vocab=4096, heads=8, kv_heads=4)
CHUNK = 4 << 20


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_llama_checkpoint(tmp_path / "m", SHAPE, files=3)


def _fill(model: Path, tp: int, rank: int, early: EarlyReads | None):
    ckpt = open_checkpoint(model)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=tp, tp_rank=rank)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    stats = load_entries(list(lay.entries), flat, threads=3, chunk=CHUNK, direct=False,
                         digest=list(ckpt.files), share=True, early=early)
    return flat, stats, lay


@pytest.mark.parametrize(("tp", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_a_tensor_parallel_ranks_early_reads_are_fill_jobs_of_its_own_chunks(model, tp, rank):
    ckpt = open_checkpoint(model)
    mine, own = tpshare.own_chunks(ckpt, parse_rules(None), tp, rank)
    assert own, "the preset splits q/k/v/gate/up along dim 0: each rank owns chunks"
    early = EarlyReads(ckpt.files, 1 << 40, chunk=CHUNK, threads=2, direct=False,
                       share=mine, own=own).start()
    early.join()
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=tp, tp_rank=rank)
    sizes = {f: f.stat().st_size for f in ckpt.files}
    fill = {(j.path, j.start, j.end) for j in plan_jobs(
        list(lay.entries), span_of(CHUNK), sizes, share_chunks(lay.entries), own) if j.digest}
    jobs = set(early._jobs)
    assert jobs and jobs <= fill
    for path, start, end in jobs:
        assert own[path] >= set(tpshare.chunks(start, end - start))
    # Every fill job made of own chunks only is one of them (the budget is unbounded).
    span = grid_span(span_of(CHUNK))
    assert jobs == {(p, s, e) for p in own for s, e in share_spans(sizes[p], span, mine[p],
                                                                    own[p])
                    if own[p] >= set(tpshare.chunks(s, e - s))}
    # Cut apart at the own chunks' edges, no own chunk is left out of them.
    assert {(p, c) for p, s, e in jobs for c in tpshare.chunks(s, e - s)} == {
        (p, c) for p, found in own.items() for c in found}

    want, plain, _ = _fill(model, tp, rank, None)
    got, stats, _ = _fill(model, tp, rank, early)
    assert torch.equal(got, want)
    assert stats.record == plain.record
    assert stats.early_bytes == early.taken_bytes == early.read_bytes > 0
    record = content.digest_files(ckpt.files)
    for name, digest in stats.record.items():  # its chunks, as a full digest has them
        full = record[name]
        for index in digest.covered:
            at = slice(index * content.DIGEST_BYTES, (index + 1) * content.DIGEST_BYTES)
            assert digest.chunks[at] == full.chunks[at]
    early.close()


def test_tensor_parallel_cpu_ranks_read_their_own_chunks_while_they_start(tmp_path, preload,
                                                                          request):
    """Through the real launcher and two ranks: each rank's READY says its early reads read
    chunks no other rank reads and its fill took them, and each serves the content it serves
    with no early reads at all."""
    model = write_llama_checkpoint(tmp_path / "m", SHAPE, files=3)
    files = open_checkpoint(model).files
    served = {}
    cleanup: list[Path] = []
    request.addfinalizer(lambda: [shutil.rmtree(d, ignore_errors=True) for d in cleanup])
    for budget in ("0", "auto"):
        drop_page_cache(files, everything=False)
        sock = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))  # short: an AF_UNIX path
        cleanup.append(sock)
        p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock),
                    "--tensor-parallel-size", "2", env={**os.environ, BUDGET_ENV: budget})
        ready = p.wait_ready(180)
        served[budget] = [query(s, "hello")["content"] for s in ready["sockets"]]
        for rank in ready["rank_loads"]:
            early, loader = rank["early"], rank["loader"]
            if budget == "0":
                assert early is None and loader["early_bytes"] == 0
                continue
            # Every early job was a fill job the fill took (read or found resident).
            assert loader["early_bytes"] == early["taken_bytes"] == early["read_bytes"]
            assert early["read_bytes"] + early["resident_bytes"] > 0
            if early["read_bytes"]:  # ... while the rank started: before torch was imported
                assert early["first_read_at"] < rank["marks"]["imported"]
        p.stop()
    assert served["auto"] == served["0"] and len(set(served["0"])) == 2


def test_a_plan_that_fails_reads_nothing_early_and_leaves_the_fill_whole(model):
    """A rule that does not divide a tensor fails the plan on the early reads' thread: nothing
    is read early, and the fill (which raises the rule's error itself when it plans) is not
    held up by it."""
    ckpt = open_checkpoint(model)

    def plan():
        raise ValueError("dim 0 of shape [1000] is not divisible by tensor-parallel-size 3")

    early = EarlyReads(ckpt.files, 1 << 40, chunk=CHUNK, threads=2, direct=False,
                       plan=plan).start()
    early.join()
    assert early.own == {} and not early._jobs and early.read_bytes == 0
    want, plain, _ = _fill(model, 2, 1, None)
    got, stats, _ = _fill(model, 2, 1, early)
    assert torch.equal(got, want) and stats.record == plain.record and stats.early_bytes == 0
    early.close()
