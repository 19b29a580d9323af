"""Update staging from a checkpoint's own pages (native/daemon/staging.py), on CPU.

The image must write exactly the bytes the loader writes (whole tensors, row splits and column
splits), carry the same content record, and never write a file that changed after it was
verified. The CUDA side (pinned pages, 2-D copies) runs in tests/gpu/test_update_cuda.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from weightcache.native.daemon import staging
from weightcache.native.shared import content
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.loader import load_into_arena
from weightcache.native.shared.rankplan import plan_rank_shard
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import TINY, write_llama_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_llama_checkpoint(tmp_path / "m", TINY, files=2, seed=3)


def _plan(path: Path, tp_size: int = 1, tp_rank: int = 0, dtype: str = "auto"):
    ckpt = open_checkpoint(path)
    layout, _ = plan_rank_shard(ckpt, parse_rules(None), tp_size=tp_size, tp_rank=tp_rank,
                                dtype=dtype)
    return ckpt, layout


@pytest.mark.parametrize(("tp_size", "tp_rank"), [(1, 0), (2, 0), (2, 1)])
def test_image_writes_the_loaders_bytes_and_record(model, tp_size, tp_rank):
    ckpt, layout = _plan(model, tp_size, tp_rank)
    share = tp_size > 1
    if share:  # the Llama preset splits some tensors by columns: rows of a file range
        assert any(staging._run(e).height > 1 for e in layout.entries if e.nbytes)
    expected = torch.zeros(layout.nbytes, dtype=torch.uint8)
    stats = load_into_arena(layout, expected, digest=list(ckpt.files), share=share)
    image, steps = staging.file_image(layout, list(ckpt.files), CPU, share=share)
    try:
        got = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8)
        image.write_into(got)
        assert image.kind == "files" and image.nbytes == layout.nbytes
        assert steps["digest_seconds"] >= 0 and steps["seconds"] >= steps["digest_seconds"]
        for e in layout.entries:  # the padding between tensors is not the image's to write
            assert torch.equal(got[e.offset: e.offset + e.nbytes],
                               expected[e.offset: e.offset + e.nbytes]), e.name
        assert content.content_root(image.record) == content.content_root(stats.record)
        assert image.record.keys() == stats.record.keys()
    finally:
        image.close()


def test_a_file_written_after_staging_is_never_written(model):
    ckpt, layout = _plan(model)
    image, _ = staging.file_image(layout, list(ckpt.files), CPU)
    try:
        victim = sorted(ckpt.files)[-1]
        with open(victim, "r+b") as f:  # the same byte back: only ctime and mtime move
            first = f.read(1)
            f.seek(0)
            f.write(first)
        with pytest.raises(content.ContentError, match="written since it was staged"):
            image.verify()
        untouched = torch.zeros(layout.nbytes, dtype=torch.uint8)
        with pytest.raises(content.ContentError, match="written since it was staged"):
            image.write_into(untouched)
        assert not untouched.any()  # refused before the first byte
    finally:
        image.close()


def test_a_replaced_or_removed_file_is_refused(model, tmp_path):
    ckpt, layout = _plan(model)
    image, _ = staging.file_image(layout, list(ckpt.files), CPU)
    try:
        victim = sorted(ckpt.files)[0]
        shutil.copy(victim, tmp_path / "copy")
        os.replace(tmp_path / "copy", victim)  # same bytes, another file
        with pytest.raises(content.ContentError, match="replaced since it was staged"):
            image.verify()
        os.unlink(victim)
        with pytest.raises(content.ContentError, match="removed since it was staged"):
            image.verify()
    finally:
        image.close()


def test_a_conversion_stages_on_the_host_and_says_why(model):
    ckpt, layout = _plan(model, dtype="float32")
    why = staging.refusal(layout, CPU)
    assert why is not None and "converted to torch.float32" in why
    with pytest.raises(staging.ImageRefused, match="converted"):
        staging.file_image(layout, list(ckpt.files), CPU)


def test_a_rollback_source_must_be_the_very_files_served(model, tmp_path):
    """With `known` (the record of the generation served) nothing is hashed: each file must
    be the one the record names, by real path and full identity (a write moves ctime)."""
    ckpt, layout = _plan(model)
    image, _ = staging.file_image(layout, list(ckpt.files), CPU)
    known = image.record
    image.close()
    same, _ = staging.file_image(layout, list(ckpt.files), CPU, known=known,
                                 resident_only=True)  # just written: in the page cache
    try:
        assert same.record == known
        got = torch.zeros(layout.nbytes, dtype=torch.uint8)
        same.write_into(got)
        expected = torch.zeros(layout.nbytes, dtype=torch.uint8)
        load_into_arena(layout, expected)
        assert torch.equal(got, expected)
    finally:
        same.close()
    copy = tmp_path / "copy"  # the same bytes elsewhere: not the files served
    shutil.copytree(model, copy)
    ckpt_copy, layout_copy = _plan(copy)
    with pytest.raises(staging.ImageRefused, match="not the file served"):
        staging.file_image(layout_copy, list(ckpt_copy.files), CPU, known=known)
    write_llama_checkpoint(model, TINY, files=2, seed=4)  # same headers, other bytes
    ckpt, layout = _plan(model)
    with pytest.raises(staging.ImageRefused, match="not the file served"):
        staging.file_image(layout, list(ckpt.files), CPU, known=known)
    with pytest.raises(staging.ImageRefused, match="not the ones served"):
        staging.file_image(layout, list(ckpt.files)[:1], CPU, known=known)


def test_host_mode_turns_images_off(model, monkeypatch):
    ckpt, layout = _plan(model)
    monkeypatch.setenv(staging.STAGING_ENV, "host")
    assert staging.refusal(layout, CPU) == f"{staging.STAGING_ENV}=host"
    with pytest.raises(staging.ImageRefused, match="=host"):
        staging.file_image(layout, list(ckpt.files), CPU)
    monkeypatch.setenv(staging.STAGING_ENV, "bogus")  # a tuning knob never fails an update
    assert staging.staging_mode() == "auto" and staging.refusal(layout, CPU) is None


def test_a_truncated_file_is_refused_at_open(model):
    ckpt, layout = _plan(model)
    victim = max(ckpt.files, key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(content.ContentError, match="truncated or replaced"):
        staging.file_image(layout, list(ckpt.files), CPU)


def test_digest_into_matches_digest_files_and_covers_only_a_share(model):
    files = sorted(open_checkpoint(model).files)
    whole = content.digest_files(files)
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    try:
        idents = {p: content.FileIdentity.of(os.fstat(fd)) for p, fd in fds.items()}
        sink = content.ChunkSink(idents, chunk_bytes=4096)
        content.digest_into(sink, fds, workers=3)
        small = sink.record()
        for p in files:  # other chunk size, same bytes: every chunk is the chunk's hash
            data = p.read_bytes()
            assert small[p.name].chunks == b"".join(
                content.chunk_digest(data[i: i + 4096]) for i in range(0, max(len(data), 1), 4096))
        sink = content.ChunkSink(idents, coverage={files[0]: {0}, files[1]: set()})
        content.digest_into(sink, fds)
        share = sink.record()
        assert share[files[0].name].chunk(0) == whole[files[0].name].chunk(0)
    finally:
        for fd in fds.values():
            os.close(fd)


def test_a_host_copy_that_leaves_no_room_for_host_staging_is_dropped(monkeypatch):
    """Staging fell back to a host buffer after the rollback copy had started beside an image
    (a driver that would not pin): a host copy that leaves no room for it is dropped, so the
    two never take the node's memory; under `rollback: require` the stage is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from weightcache.native.daemon import updater
    from weightcache.native.shared import protocol as proto
    from weightcache.native.shared.errors import UpdateError

    def copy() -> tuple[staging.HostBuffer, str, float]:
        return staging.HostBuffer(torch.zeros(1024, dtype=torch.uint8)), "", 0.5

    monkeypatch.setattr(updater, "host_memory_available", lambda: 2 << 30)  # 2 GiB free
    with ThreadPoolExecutor(1) as pool:
        plenty = updater._Keeping(pool, copy, "auto")
        plenty.start()
        plenty.make_room(1 << 30)  # 1 GiB of staging and the 512 MiB reserve fit
        assert plenty.result()[0] is not None
        short = updater._Keeping(pool, copy, "auto")
        short.start()
        short.make_room(4 << 30)
        previous, why, seconds = short.result()
        assert previous is None and why.startswith("host memory") and seconds == 0.5
        strict = updater._Keeping(pool, copy, "require")
        strict.start()
        with pytest.raises(UpdateError) as refused:
            strict.make_room(4 << 30)
        assert refused.value.code == proto.E_NO_ROLLBACK
        idle = updater._Keeping(pool, copy, "auto")
        idle.make_room(4 << 30)  # nothing started: nothing to drop
        assert idle.result()[0] is not None
