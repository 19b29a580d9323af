"""Bad input gets one clear error and a non-zero exit, before anything is served."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcache.native.daemon import launcher as preload
from weightcache.native.engine.attach import attach
from weightcache.native.shared.checkpoint import INDEX_NAME, CheckpointError, open_checkpoint
from weightcache.native.shared.sharding import ShardingError, parse_rule, parse_rules, plan_shard


def run_preload(caplog, *args: str) -> tuple[int, str]:
    caplog.clear()
    code = preload.main(list(args))
    return code, caplog.text


def write_raw(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def bad_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    return d


def corrupt_cases(d: Path) -> dict[str, tuple[Path, str]]:
    cases = {}

    def case(name: str, header: bytes | None, data: bytes, message: str, raw: bytes = b""):
        sub = d / name
        sub.mkdir()
        if header is None:
            (sub / "model.safetensors").write_bytes(raw)
        else:
            write_raw(sub / "model.safetensors", header, data)
        cases[name] = (sub, message)

    case("truncated", None, b"", "corrupt safetensors header", raw=b"\x01\x02")
    too_long = struct.pack("<Q", 10**6) + b"{}"
    case("length-past-end", None, b"", "declared header length", raw=too_long)
    case("not-json", b"{not json", b"", "not JSON")
    case("not-object", b"[1, 2]", b"", "not a JSON object")
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    case("offsets-past-data", json.dumps({"w": entry}).encode(), b"\x00" * 8, "bad data_offsets")
    case("size-mismatch", json.dumps({"w": {**entry, "shape": [3, 2]}}).encode(), b"\x00" * 16,
         "needs 24")
    case("bad-dtype", json.dumps({"w": {**entry, "dtype": "F128"}}).encode(), b"\x00" * 16,
         "unsupported dtype")
    case("bad-shape", json.dumps({"w": {**entry, "shape": [-1, 2]}}).encode(), b"\x00" * 16,
         "bad shape")
    return cases


def test_corrupt_safetensors_headers_are_named(bad_dir, caplog, sock_dir):
    for name, (path, message) in corrupt_cases(bad_dir).items():
        with pytest.raises(CheckpointError, match=message):
            open_checkpoint(path)
        code, log = run_preload(caplog, "--model", str(path),
                                "--weight-cache-socket-dir", str(sock_dir))
        assert code == preload.EXIT_BAD_INPUT, name
        assert message in log and "model.safetensors" in log, name
        # The client treats a broken checkpoint as a configuration error, fallback or not.
        with pytest.raises(CheckpointError):
            attach(path, socket_dir=sock_dir, fallback=True)
    assert os.listdir(sock_dir) == []


def test_missing_empty_and_non_directory_models(tmp_path, caplog, sock_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for model, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "contains no .safetensors files"),
        (tmp_path / "file", "is not a directory"),
    ]:
        code, log = run_preload(caplog, "--model", str(model),
                                "--weight-cache-socket-dir", str(sock_dir))
        assert code == preload.EXIT_BAD_INPUT and message in log


def test_broken_index_is_refused(ckpt, tmp_path, caplog, sock_dir):
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    index = json.loads((model / INDEX_NAME).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (model / first).unlink()
    code, log = run_preload(caplog, "--model", str(model), "--weight-cache-socket-dir",
                            str(sock_dir))
    assert code == 2 and f"references missing file {first}" in log
    (model / INDEX_NAME).write_text("{")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        open_checkpoint(model)


def test_shard_rule_that_does_not_divide(tmp_path, caplog, sock_dir):
    model = tmp_path / "odd"
    model.mkdir()
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(5, 4)},
              str(model / "model.safetensors"))
    code, log = run_preload(caplog, "--model", str(model), "--tensor-parallel-size", "2",
                            "--weight-cache-socket-dir", str(sock_dir))
    assert code == 2
    assert "dim 0 of shape [5, 4] (5) is not divisible by tensor-parallel-size 2" in log
    assert os.listdir(sock_dir) == []
    # The same tensor split along a dim that divides is fine.
    assert plan_shard("x.q_proj.weight", (5, 4), parse_rules(["q_proj=1"]), 2, 1).shape == (5, 2)


def test_shard_rule_syntax_and_dims():
    for text, message in [("nodim", "REGEX=DIM"), ("=0", "REGEX=DIM"), ("x=y", "not an integer"),
                          ("(=0", "bad regex")]:
        with pytest.raises(ShardingError, match=message):
            parse_rule(text)
    rules = parse_rules(["w=2"])
    with pytest.raises(ShardingError, match="out of range"):
        plan_shard("w", (4, 4), rules, 2, 0)
    assert plan_shard("w", (4, 6), parse_rules(["w=-1"]), 2, 1).start == 3
    assert plan_shard("norm", (4,), parse_rules(None), 2, 1).dim is None  # replicated


def test_tp_larger_than_devices(ckpt, caplog, sock_dir):
    too_many = (os.cpu_count() or 1) + 1
    code, log = run_preload(caplog, "--model", str(ckpt), "--tensor-parallel-size",
                            str(too_many), "--weight-cache-socket-dir", str(sock_dir))
    assert code == 2 and f"--tensor-parallel-size {too_many} exceeds the" in log
    code, log = run_preload(caplog, "--model", str(ckpt), "--tensor-parallel-size", "0")
    assert code == 2 and "must be >= 1" in log
