"""`weightcache demo`: the restart story on a generated checkpoint, in one command.

It writes a small Llama-shaped checkpoint (random weights, safetensors, two files plus an
index), measures an engine-style load from disk, starts `weightcache preload` (CUDA when a GPU
is present, else CPU), attaches the way a restarting engine would (`weightcache attach`, a
fresh process each time, in both modes), and prints the times side by side. Everything it
starts is stopped and everything it writes is removed unless --keep is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from weightcache.cliformat import HelpFormatter
from weightcache.testing.checkpoints import (
    DEMO,
    TINY,
    sync_files,
    write_llama_checkpoint,
)
from weightcache.testing.processes import Preload, run_attach


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache demo", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks to start (one per device)")
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and sockets")
    p.add_argument("--small", action="store_true", help="a tiny checkpoint (for smoke tests)")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    elif device == "cuda" and not _cuda_available():
        print("weightcache demo: --device cuda: no CUDA device is visible here; use --device cpu"
              " (or auto), or check the NVIDIA driver and CUDA_VISIBLE_DEVICES", file=sys.stderr)
        return 2
    try:
        return _run(args, device)
    except (RuntimeError, TimeoutError) as exc:  # a step failed: its own error, one line
        first = str(exc).strip().splitlines()
        print(f"weightcache demo: {first[0] if first else type(exc).__name__}"
              " (rerun the failing step by hand for its full output)", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, device: str) -> int:
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
