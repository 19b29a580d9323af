"""Fixtures for the GPU tests: a small generated checkpoint and real daemon processes.

Tests marked `gpu` are skipped unless torch sees a CUDA device and the driver bindings
(`cuda-python`) import; the unmarked CPU tests in this folder run everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def cuda_ready() -> tuple[bool, str]:
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device"
    except RuntimeError as exc:
        return False, f"CUDA unusable: {exc}"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        try:
            from cuda import cuda  # noqa: F401
        except ImportError:
            return False, "cuda-python (driver bindings) not installed"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = cuda_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and os.geteuid() == 0


def write_checkpoint(path: Path, *, layers: int = 2, hidden: int = 512, seed: int = 0) -> Path:
    """A small Llama-shaped bf16 checkpoint in two shards, random (never zero) values."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    inter, vocab, kv = hidden * 3, 4096, hidden // 4

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": rnd(hidden, hidden),
                p + "self_attn.k_proj.weight": rnd(kv, hidden),
                p + "self_attn.v_proj.weight": rnd(kv, hidden),
                p + "self_attn.o_proj.weight": rnd(hidden, hidden),
                p + "mlp.gate_proj.weight": rnd(inter, hidden),
                p + "mlp.up_proj.weight": rnd(inter, hidden),
                p + "mlp.down_proj.weight": rnd(hidden, inter),
                p + "input_layernorm.weight": rnd(hidden),
                p + "post_attention_layernorm.weight": rnd(hidden),
            }
        )
    tensors["model.norm.weight"] = rnd(hidden)
    tensors["lm_head.weight"] = rnd(vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, path / "model-00002-of-00002.safetensors")
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return path


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("model") / "llama-small")


class Daemon:
    def __init__(self, proc: subprocess.Popen, info: dict, socket_dir: Path) -> None:
        self.proc = proc
        self.info = info
        self.socket_dir = socket_dir

    @property
    def socket(self) -> str:
        return self.info["socket"]

    def stop(self, sig: int = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def daemon_command(model: Path, socket_dir: Path, transport: str) -> list[str]:
    return [
        sys.executable, "-m", "weightcache.native.daemon", "--model", str(model),
        "--device", "cuda", "--device-index", "0", "--transport", transport,
        "--weight-cache-socket-dir", str(socket_dir),
    ]


def start_daemon(
    model: Path, socket_dir: Path, transport: str, prefix: list[str] | None = None,
    timeout: float = 240.0, suffix: list[str] | None = None,
) -> Daemon:
    cmd = [*(prefix or []), *daemon_command(model, socket_dir, transport), *(suffix or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("SERVING "):
            return Daemon(proc, json.loads(line[len("SERVING ") :]), socket_dir)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"daemon did not serve (exit {proc.returncode}): {' '.join(cmd)}")


@pytest.fixture
def daemon_factory() -> Iterator:
    # Socket paths are limited to 107 bytes and GPU UUIDs are long: keep the directory short.
    root = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    started: list[Daemon] = []

    def make(model: Path, transport: str, prefix: list[str] | None = None,
             suffix: list[str] | None = None) -> Daemon:
        d = start_daemon(model, root / f"s{len(started)}", transport, prefix, suffix=suffix)
        started.append(d)
        return d

    yield make
    for d in started:
        with contextlib.suppress(Exception):
            d.stop()
    shutil.rmtree(root, ignore_errors=True)


PROBE = str(Path(__file__).with_name("probe.py"))


@pytest.fixture(scope="session")
def medium_model(tmp_path_factory) -> Path:
    # ~240 MB: large enough that memory deltas stand out from allocator noise.
    return write_checkpoint(tmp_path_factory.mktemp("m") / "medium", layers=2, hidden=2048)


def run_probe(model: Path, sock: str, mode: str = "zero_copy", env=None, prefix=None,
              extra=()) -> tuple[int, dict]:
    cmd = [*(prefix or []), sys.executable, PROBE, "--model", str(model), "--socket", sock,
           "--mode", mode, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})}, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {"stderr": out.stderr[-3000:]}
    print("probe", mode, out.returncode, json.dumps(report))
    return out.returncode, report
