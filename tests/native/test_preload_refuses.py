"""`weightcache preload` on bad input: one line naming the file, the documented exit code.

Mutated checkpoints come from the same strategy as the client's property tests; safetensors
itself is the judge of what must be refused (test_robustness.py says where its rules live).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.processes import Preload, weightcache_cmd

from .test_robustness import mutated_file, safetensors_reads


def preload(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*weightcache_cmd(), "preload", "--exit-with-parent", *args],
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in out.stderr.splitlines() if ln.strip()]


@settings(max_examples=int(os.environ.get("PRELOAD_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(blob=mutated_file())
def test_every_file_safetensors_refuses_is_refused_with_exit_2(blob, tmp_path_factory):
    model = tmp_path_factory.mktemp("m")
    path = model / "model.safetensors"
    path.write_bytes(blob)
    if safetensors_reads(path) is not None:
        return  # the other test covers what safetensors reads
    out = preload("--model", str(model), "--weight-cache-socket-dir",
                  str(tmp_path_factory.mktemp("s")), timeout=60)
    lines = error_lines(out)
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(model) in lines[0]


def test_exit_3_when_another_daemon_serves_the_device(ckpt, sock_dir):
    first = Preload(["--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir)])
    try:
        first.wait_ready(120)
        out = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
        assert out.returncode == 3 and "already serves" in out.stderr
    finally:
        first.stop()


def test_exit_4_for_a_planted_file_at_the_socket_path_before_loading(ckpt, sock_dir):
    planted = socket_path(sock_dir, cpu_identity(0))
    Path(planted).write_text("not a socket")
    out = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    assert out.returncode == 4, out.stderr
    assert "not a stale socket of ours" in out.stderr
    assert Path(planted).read_text() == "not a socket"  # left alone


def test_exit_4_for_a_world_writable_socket_directory(ckpt, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    out = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(d))
    assert out.returncode == 4 and len(error_lines(out)) == 1


@pytest.mark.parametrize("args", [
    ["--tensor-parallel-size", "0"],
    ["--shard-rule", "(=0"],
    ["--dtype", "int4"],
])
def test_exit_2_for_bad_flags(ckpt, sock_dir, args):
    out = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_exit_2_for_a_missing_model(sock_dir, tmp_path):
    out = preload("--model", str(tmp_path / "nope"), "--weight-cache-socket-dir", str(sock_dir))
    assert out.returncode == 2 and len(error_lines(out)) == 1


@pytest.mark.parametrize("name,value", [
    ("WEIGHTCACHE_LOAD_YIELD", "sometimes"), ("WEIGHTCACHE_LOAD_THREADS", "0"),
    ("WEIGHTCACHE_LOAD_CHUNK_MIB", "big"), ("WEIGHTCACHE_LOAD_DIRECT", "maybe"),
    ("WEIGHTCACHE_LOAD_IO_PRIORITY", "high"), ("WEIGHTCACHE_LOAD_HOT_STEP_MIB", "0"),
])
def test_exit_2_for_a_bad_load_knob(ckpt, sock_dir, name, value):
    """The load's knobs are checked by every rank before it loads (any other load, an
    engine's disk fallback, takes a bad value as its default and never fails on it)."""
    out = subprocess.run([*weightcache_cmd(), "preload", "--exit-with-parent", "--model",
                          str(ckpt), "--weight-cache-socket-dir", str(sock_dir)],
                         capture_output=True, text=True, timeout=120, cwd="/",
                         env={**os.environ, name: value})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert name in out.stderr
