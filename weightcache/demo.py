"""`weightcache demo`: the restart story on a generated checkpoint, in one command.

It writes a small Llama-shaped checkpoint (random weights, safetensors, two files plus an
index), measures an engine-style load from disk, starts `weightcache preload` (CUDA when a GPU
is present, else CPU), attaches the way a restarting engine would (`weightcache attach`, a
fresh process each time, in both modes), and prints the times side by side. Everything it
starts is stopped and everything it writes is removed unless --keep is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 1024
    layers: int = 8
    intermediate: int = 2816
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 4
    tied: bool = True

    def nbytes(self, itemsize: int = 2) -> int:
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        per_layer = (
            2 * self.hidden * self.hidden
            + 2 * kv * self.hidden
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden
        )
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * per_layer + embed + self.hidden) * itemsize


TINY = LlamaShape(hidden=64, layers=2, intermediate=128, vocab=256, heads=4, kv_heads=2)
DEMO = LlamaShape()


def write_llama_checkpoint(
    path: str | os.PathLike,
    shape: LlamaShape = TINY,
    *,
    dtype: str = "bfloat16",
    files: int = 2,
    seed: int = 0,
) -> Path:
    """A Llama-named safetensors checkpoint with random weights and a config.json."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(tdtype)

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(shape.vocab, shape.hidden)
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(shape.hidden, shape.hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv, shape.hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv, shape.hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(shape.hidden, shape.hidden)
        tensors[p + "mlp.gate_proj.weight"] = rand(shape.intermediate, shape.hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(shape.intermediate, shape.hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(shape.hidden, shape.intermediate)
        tensors[p + "input_layernorm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
    tensors["model.norm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
    if not shape.tied:
        tensors["lm_head.weight"] = rand(shape.vocab, shape.hidden)

    names = list(tensors)
    files = max(1, min(files, len(names)))
    per = -(-len(names) // files)
    weight_map: dict[str, str] = {}
    for n in range(files):
        chunk = names[n * per : (n + 1) * per]
        if not chunk:
            continue
        fname = (
            "model.safetensors" if files == 1 else f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        )
        save_file({k: tensors[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, fname))
    if files > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def sync_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def weightcache_cmd() -> list[str]:
    return [sys.executable, "-m", "weightcache.cli"]


class Preload:
    """A `weightcache preload` child: start, wait for READY, stop (SIGTERM, then SIGKILL).

    It runs with --exit-with-parent, so it never outlives us even if we are killed outright.
    """

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*weightcache_cmd(), "preload", "--exit-with-parent", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.ready: dict[str, Any] | None = None
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(
                    f"weightcache preload exited ({self.proc.wait()}) before READY:\n{err}"
                )
            self.lines.append(line)
            if line.startswith("READY "):
                self.ready = json.loads(line[len("READY ") :])
                return self.ready
        raise TimeoutError("weightcache preload did not become ready")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return self.proc.returncode


def run_attach(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `weightcache attach` in a fresh process, like a restarting engine."""
    out = subprocess.run(
        [*weightcache_cmd(), "attach", *args], capture_output=True, text=True, env=env, check=False
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"weightcache attach failed ({out.returncode}):\n{out.stderr}")
    return json.loads(lines[-1])


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache demo", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and sockets")
    p.add_argument("--small", action="store_true", help="a tiny checkpoint (for smoke tests)")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    work = Path(args.dir or tempfile.mkdtemp(prefix="weightcache-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    model, sockets = work / "model", work / "sockets"
    sockets.mkdir(mode=0o700, exist_ok=True)
    os.chmod(sockets, 0o700)
    shape = TINY if args.small else DEMO
    tp = args.tensor_parallel_size
    preload: Preload | None = None
    try:
        print(f"[1/4] writing a Llama-shaped checkpoint ({shape.nbytes() / 1e6:.0f} MB bf16)"
              f" to {model}", flush=True)
        write_llama_checkpoint(model, shape, files=2)
        sync_files(model)  # so that write-back does not run during the timings
        common = ["--model", str(model), "--device", device, "--tensor-parallel-size", str(tp)]
        print("[2/4] restart from disk (what an engine pays without the cache)", flush=True)
        disk = run_attach([*common, "--weight-cache-socket-dir", str(sockets)])
        print(f"[3/4] starting weightcache preload on {device} (TP={tp})", flush=True)
        t0 = time.perf_counter()
        preload = Preload([*common, "--weight-cache-socket-dir", str(sockets)])
        ready = preload.wait_ready()
        print(f"      READY in {time.perf_counter() - t0:.2f} s: {ready['ranks']} rank(s),"
              f" {ready['bytes'] / 1e6:.0f} MB cached", flush=True)
        print("[4/4] restart from the cache (fresh attach processes)", flush=True)
        cache_args = [*common, "--weight-cache-socket-dir", str(sockets), "--no-fallback"]
        zero = run_attach([*cache_args, "--mode", "zero_copy"])
        copy = run_attach([*cache_args, "--mode", "copy"])
        rows = [("disk (page cache warm)", disk), ("cache, zero_copy", zero), ("cache, copy", copy)]
        print()
        print(f"{'restart path':<24} {'source':<7} {'tensors':>7} {'MB':>8} {'seconds':>9}"
              f" {'vs disk':>8}")
        for label, r in rows:
            ratio = disk["seconds"] / r["seconds"] if r["seconds"] > 0 else float("inf")
            print(f"{label:<24} {r['source']:<7} {r['tensors']:>7} {r['bytes'] / 1e6:>8.1f}"
                  f" {r['seconds']:>9.4f} {ratio:>7.1f}x")
        print()
        print(f"restart from cache (zero_copy) is {disk['seconds'] / zero['seconds']:.1f}x faster"
              f" than from disk on {device}")
        return 0
    finally:
        if preload is not None:
            code = preload.stop()
            print(f"stopped weightcache preload (exit {code})")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
