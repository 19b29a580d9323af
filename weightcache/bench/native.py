"""Native section of `weightcache bench`: engine-side attach vs. loading from disk.

One run writes a Llama-shaped checkpoint, measures the restart an engine pays without the
cache (load from disk with page cache warm and, where `posix_fadvise` can evict it, cold),
starts `weightcache preload`, and measures attach in zero_copy and copy mode against that
baseline. Times are the medians of --repeat runs, taken in this process after imports, i.e.
exactly what `load_state_dict` costs an engine that is already up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from weightcache.bench.report import add_smoke_flag


def _sync_and_drop(model: Path, *, drop: bool) -> bool:
    """Write the checkpoint back (so writeback does not disturb timings) and optionally evict
    its pages from the page cache (no root needed); False where the OS offers no way."""
    if drop and not hasattr(os, "posix_fadvise"):
        return False
    for path in model.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache bench native")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--small", action="store_true", help="tiny checkpoint (smoke test)")
    add_smoke_flag(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.small, args.repeat = True, 1

    import torch

    from weightcache.bench.report import print_ratios
    from weightcache.native.engine.attach import attach
    from weightcache.testing.checkpoints import DEMO, TINY, write_llama_checkpoint
    from weightcache.testing.processes import Preload

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("  skipped: --device cuda but no CUDA device is visible")
        return 0
    work = Path(tempfile.mkdtemp(prefix="weightcache-bench-"))
    preload = None
    try:
        model, sockets = work / "model", work / "sockets"
        shape = TINY if args.small else DEMO
        write_llama_checkpoint(model, shape, files=2)
        _sync_and_drop(model, drop=False)
        sockets.mkdir(mode=0o700)
        none_dir = work / "no-daemon"
        none_dir.mkdir(mode=0o700)

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        def from_disk() -> None:
            r = attach(model, device=device, socket_dir=none_dir, fallback=True)
            assert r.source == "disk"
            sync()

        import logging

        logging.getLogger("weightcache.client").setLevel(logging.ERROR)
        from_disk()  # warm the page cache and the code paths
        warm = _median(from_disk, args.repeat)
        cold = None
        if _sync_and_drop(model, drop=True):
            colds = []
            for _ in range(min(args.repeat, 3)):
                _sync_and_drop(model, drop=True)
                t0 = time.perf_counter()
                from_disk()
                colds.append(time.perf_counter() - t0)
            cold = statistics.median(colds)

        t0 = time.perf_counter()
        preload = Preload(["--model", str(model), "--device", device,
                           "--weight-cache-socket-dir", str(sockets)])
        ready = preload.wait_ready()
        cold_start = time.perf_counter() - t0

        def zero_copy() -> None:
            r = attach(model, device=device, socket_dir=sockets, mode="zero_copy", fallback=False)
            sync()
            del r

        zero_copy()
        zero = _median(zero_copy, args.repeat)
        def copy_mode() -> None:  # copy mode leaves the cache in place: a median too
            r = attach(model, device=device, socket_dir=sockets, mode="copy", fallback=False)
            sync()
            del r

        copy = _median(copy_mode, args.repeat)

        rows = [("attach zero_copy", zero), ("attach copy", copy)]
        if cold is not None:
            rows.insert(0, ("load from disk, page cache dropped", cold))
        print_ratios(
            f"native ({device}): {ready['bytes'] / 1e6:.1f} MB, Llama-shaped, TP=1,"
            f" median of {args.repeat}",
            ("load from disk, page cache warm", warm),
            rows,
            notes=[f"preload cold start to READY: {cold_start:.2f} s"
                   f" (daemon load {ready['seconds']:.2f} s incl. interpreter start)"],
        )
        return 0
    finally:
        if preload is not None:
            preload.stop()
        shutil.rmtree(work, ignore_errors=True)
