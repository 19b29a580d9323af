"""The cache serves the bytes safetensors stores, for every dtype, whole or split.

A tensor kept in its stored dtype is copied as bytes, never through a typed view: a typed
copy rewrites a BOOL byte that is neither 0 nor 1 to 0x01 (and could canonicalise other
patterns). The checkpoint is written by hand (header + raw bytes) so every byte pattern is
possible; each path that fills an arena (the daemon over its socket, TP=1 and TP=2 with a
row split; the client's disk fallback; the cold loader's staged path on CPU) is compared
with safetensors' own reader of the same file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from weightcache.client import attach
from weightcache.native.shared import coldload
from weightcache.native.shared.checkpoint import DTYPES, open_checkpoint
from weightcache.native.shared.loader import load_into_arena, plan_layout
from weightcache.native.shared.sharding import parse_rules

# Rows of every dtype; every byte value appears (BOOL 0x00..0xff, float NaN payloads...).
ROWS, COLS = 4, 64


def write_every_dtype(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    header: dict[str, dict] = {}
    data = bytearray()
    for i, (tag, (_, size)) in enumerate(sorted(DTYPES.items())):
        nbytes = ROWS * COLS * size
        header[f"t_{tag}"] = {"dtype": tag, "shape": [ROWS, COLS],
                                 "data_offsets": [len(data), len(data) + nbytes]}
        data += bytes((k * 37 + i) % 256 for k in range(nbytes))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


def stored(model: Path) -> dict[str, bytes]:
    with safe_open(str(model / "model.safetensors"), "pt") as fh:
        return {k: fh.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()
                for k in fh.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = write_every_dtype(tmp_path_factory.mktemp("every-dtype") / "m")
    assert any(b not in (0, 1) for b in stored(path)["t_BOOL"])  # the case that was mangled
    return path


def test_the_daemon_serves_the_stored_bytes_of_every_dtype(model, preload, sock_dir):
    want = stored(model)
    preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir)).wait_ready(120)
    res = attach(model, socket_dir=sock_dir, fallback=False)
    assert res.source == "cache"
    for name, data in want.items():
        assert as_bytes(res.state_dict[name]) == data, name
    disk = attach(model, socket_dir=sock_dir / "none", fallback=True)
    assert disk.source == "disk"
    for name, data in want.items():
        assert as_bytes(disk.state_dict[name]) == data, name


def test_a_row_split_keeps_every_element_whole(model, preload, sock_dir):
    want = stored(model)
    p = preload("--model", str(model), "--weight-cache-socket-dir", str(sock_dir),
                "--tensor-parallel-size", "2", "--shard-rule", "t=0")
    p.wait_ready(120)
    for rank in range(2):
        res = attach(model, socket_dir=sock_dir, tp_size=2, tp_rank=rank, device_index=rank,
                     shard_rules=["t=0"], fallback=False)
        assert res.source == "cache"
        for name, data in want.items():
            half = len(data) // 2
            assert as_bytes(res.state_dict[name]) == data[rank * half:(rank + 1) * half], name


def test_the_cold_loaders_staged_path_copies_bytes(model):
    """The CUDA loader's per-tensor path (split or converted tensors), run on CPU."""
    want = stored(model)
    ckpt = open_checkpoint(model)
    layout = plan_layout(ckpt, rules=parse_rules(["t=0"]), tp_size=2, tp_rank=1)
    got = torch.zeros(layout.nbytes, dtype=torch.uint8)
    coldload.load_entries(list(layout.entries), got, threads=2, chunk=4096, direct=False)
    ref = torch.zeros(layout.nbytes, dtype=torch.uint8)
    load_into_arena(layout, ref)
    for entry in layout.entries:
        data = want[entry.name]
        half = data[len(data) // 2:]
        assert as_bytes(got[entry.offset:entry.offset + entry.nbytes]) == half, entry.name
        assert as_bytes(ref[entry.offset:entry.offset + entry.nbytes]) == half, entry.name
