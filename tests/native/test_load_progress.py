"""Cold loader correctness on the layouts users have, page-cache residency, and load progress.

The loader's output is compared byte for byte with safetensors' own `load_file` (the format's
reference reader) for `save_pretrained`-style shards with an index, one large file, and one
file per tensor, in each read mode (page cache, O_DIRECT, auto). Progress is checked as
values (bytes, rates, ETA, output form), never as timings.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightcache.native.daemon.config import BIND_DELAY_ENV
from weightcache.native.daemon.progress import Counter, ProgressPrinter, describe, eta_seconds
from weightcache.native.shared.checkpoint import open_checkpoint, tied_aliases
from weightcache.native.shared.coldload import drop_page_cache, load_entries
from weightcache.native.shared.loadenv import direct_mode
from weightcache.native.shared.loader import load_into_arena, plan_layout, tensors_from_table
from weightcache.native.shared.residency import resident, resident_pages
from weightcache.native.shared.sharding import parse_rules
from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

from .test_lifecycle import http_status

SHAPE = LlamaShape(hidden=128, layers=3, intermediate=384, vocab=512, heads=4, kv_heads=2,
                   tied=False)
LAYOUTS = {"sharded": 3, "single": 1, "many": 30}  # files; 30 = one file per tensor


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_dir(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layouts") / request.param
    return write_llama_checkpoint(out, SHAPE, files=LAYOUTS[request.param])


def _reference(model: Path) -> dict[str, torch.Tensor]:
    ref: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(model).files:
        ref.update({k: v.clone() for k, v in load_file(str(f)).items()})
    return ref


@pytest.mark.parametrize("mode", ["auto", True, False])
def test_loader_is_byte_equal_to_safetensors(layout_dir, mode):
    ckpt = open_checkpoint(layout_dir)
    assert len(ckpt.files) == LAYOUTS[layout_dir.name]
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0,
                      aliases=tied_aliases(ckpt))
    ref = _reference(layout_dir)
    drop_page_cache(ckpt.files)
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    seen = Counter()
    # A chunk smaller than the tensors, so reads split tensors and join neighbours.
    stats = load_entries(list(lay.entries), flat, threads=4, chunk=64 << 10, direct=mode,
                         progress=seen.add)
    state = tensors_from_table(flat, lay.table(), lay.aliases)
    assert set(state) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert seen.value == lay.nbytes == stats.nbytes
    assert stats.cached_bytes + stats.direct_bytes == stats.read_bytes >= lay.nbytes
    if mode is False:
        assert stats.direct_bytes == 0


def test_cpu_loader_reports_progress_per_read(layout_dir):
    """The CPU arena goes through the same parallel reader: progress per finished read."""
    ckpt = open_checkpoint(layout_dir)
    lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=2, tp_rank=1)
    seen: list[int] = []
    flat = torch.zeros(lay.nbytes, dtype=torch.uint8)
    load_into_arena(lay, flat, progress=seen.append)
    assert sum(seen) == sum(e.nbytes for e in lay.entries)
    assert all(n > 0 for n in seen) and seen


def test_direct_mode_values():
    assert direct_mode(None) == "auto" and direct_mode("AUTO") == "auto"
    assert direct_mode("1") is True and direct_mode("no") is False and direct_mode(True) is True
    with pytest.raises(ValueError, match="WEIGHTCACHE_LOAD_DIRECT"):
        direct_mode("sometimes")


def test_residency_follows_the_page_cache(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        found = resident_pages(fd, 0, 1 << 20)
        if found is None:
            pytest.skip("this kernel answers neither cachestat nor mincore")
        assert found == (0, 256) and not resident(fd, 0, 1 << 20)
        os.pread(fd, 4096, 8192)  # one page (readahead may add more after it)
        assert resident(fd, 8192, 4096)
        assert resident_pages(fd, 8192, 4096) == (1, 1)
        assert resident(fd, 0, 0)
    finally:
        os.close(fd)


def test_progress_text_and_eta():
    assert eta_seconds(0, 100, 1.0) is None
    assert eta_seconds(25, 100, 2.0) == pytest.approx(6.0)
    assert describe(5_200_000_000, 16_060_000_000, 2.6) == (
        "5.20/16.06 GB (32%), 2.00 GB/s, ETA 5s")
    assert describe(1_000_000_000, 400_000_000_000, 1.0).endswith("ETA 6m39s")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_is_rate_limited_lines():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, "preload m", tty=False, clock=clock)
    assert p.interval == 5.0
    assert p.update(1_000_000_000, 4_000_000_000, 1.0)
    clock.now += 1
    assert not p.update(2_000_000_000, 4_000_000_000, 2.0)  # too soon
    clock.now += 5
    assert p.update(3_000_000_000, 4_000_000_000, 3.0)
    p.finish(4_000_000_000, 4.0)
    lines = out.getvalue().splitlines()
    assert lines == ["preload m: 1.00/4.00 GB (25%), 1.00 GB/s, ETA 3s",
                     "preload m: 3.00/4.00 GB (75%), 1.00 GB/s, ETA 1s",
                     "preload m: loaded 4.00 GB in 4.00 s (1.00 GB/s)"]
    assert "\r" not in out.getvalue()


def test_terminal_progress_redraws_one_line_with_a_bar():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, "preload m", tty=True, clock=clock)
    assert p.interval == 0.2
    p.update(1, 4, 1.0)
    clock.now += 0.3
    p.update(2, 4, 2.0)
    p.finish(4, 2.0)
    text = out.getvalue()
    assert text.count("\r") == 2 and "[" + "#" * 14 + "-" * 14 + "]" in text
    assert text.endswith("\npreload m: loaded 0.00 GB in 2.00 s (0.00 GB/s)\n")


def test_health_shows_bytes_loaded_and_ready_carries_the_rate(ckpt, sock_dir, preload):
    """While a rank holds its loaded shard unbound, /health says loading with every byte in;
    READY then carries bytes, seconds, GB/s and the rank's own phases; stderr has the lines."""
    env = {**os.environ, BIND_DELAY_ENV: "3", "WEIGHTCACHE_PROGRESS_INTERVAL_S": "0.1"}
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                "--weight-cache-health-port", "0", env=env)
    health = json.loads(p.proc.stdout.readline().removeprefix("HEALTH "))["url"]
    body: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        code, body = http_status(health)
        if code == 503 and body.get("bytes_loaded"):
            break
        time.sleep(0.05)
    rank = body["ranks"][0]
    assert rank["state"] == "loading"
    assert rank["bytes_loaded"] == rank["bytes"] == body["bytes_loaded"] == body["bytes"] > 0
    ready = p.wait_ready(60)
    assert ready["bytes"] == rank["bytes"]
    assert ready["bytes"] >= open_checkpoint(ckpt).nbytes - 2 * 64 * 256  # tied lm_head served once
    assert ready["gb_per_s"] == pytest.approx(ready["bytes"] / ready["seconds"] / 1e9, rel=0.01)
    phases = ready["rank_loads"][0]["phases"]
    assert {"startup_seconds", "plan_seconds", "allocate_seconds", "fill_seconds"} <= set(phases)
    # The start's marks, one clock across the launcher and its rank, in the order they pass.
    launcher, marks = ready["marks"], ready["rank_loads"][0]["marks"]
    order = [launcher["main"], launcher["validated"], launcher["spawned"], marks["exec"],
             marks["run"], marks["input"], marks["locked"], marks["early_started"],
             marks["imported"], marks["serving"]]
    assert order == sorted(order), (launcher, marks)
    assert marks["serving"] - launcher["main"] >= 3  # the bind delay is inside READY
    assert ready["seconds"] == pytest.approx(marks["serving"] - launcher["main"], abs=0.5)
    code, body = http_status(health)
    assert code == 200 and body["bytes_loaded"] == body["bytes"] == ready["bytes"]
    p.proc.send_signal(signal.SIGTERM)
    _, err = p.proc.communicate(timeout=30)
    assert "preload tiny: loaded" in err and "GB/s" in err
