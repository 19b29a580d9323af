"""The warm fill's digest piece (`coldload.HOT_STEP`): 1 MiB against 4 MiB, in turn.

The fill reads a page-cache range in HOT_STEP pieces and hashes each right after its copy, so
that the hash reads it from the CPU's cache rather than memory. HOT_STEP was written as four
content chunks when a chunk was 256 KiB (1 MiB); chunks became 1 MiB and the piece 4 MiB,
larger than one core's L2. This loads a 0.8 GB single-file checkpoint from a warm page cache
into an arena with the digest (CPU, or a GPU's through the fill's pinned buffers), each piece
size in turn (the order swapped every round); LAYERS of 32 MiB each (default 24: 0.8 GB).

    .venv/bin/python -P docs/results/cpu-2026-12-06-hotstep/probe_hotstep.py THREADS ROUNDS \
        [DEVICE [LAYERS]]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightcache.native.shared import coldload
from weightcache.native.shared.checkpoint import open_checkpoint
from weightcache.native.shared.loader import plan_layout
from weightcache.native.shared.sharding import parse_rules


def main() -> None:
    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else 24
    with tempfile.TemporaryDirectory(prefix="wc-hotstep-", dir="/var/tmp") as tmp:
        d = Path(tmp)
        g = torch.Generator().manual_seed(0)
        save_file({f"layer{i}.weight": torch.randint(0, 255, (4096, 8192), dtype=torch.uint8,
                                                     generator=g).view(torch.bfloat16)
                   for i in range(layers)}, str(d / "model.safetensors"))
        (d / "config.json").write_text("{}")
        ckpt = open_checkpoint(d)
        lay = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0)
        flat = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
        files = list(ckpt.files)
        a, b = (int(v) for v in os.environ.get("HOT_STEP_AB", "1,4").split(","))
        out: dict[int, list[float]] = {a: [], b: []}
        hashed: dict[int, list[float]] = {a: [], b: []}
        for r in range(rounds + 1):  # round 0 warms the page cache and the allocator
            for mib in ((a, b) if r % 2 else (b, a)):
                coldload.HOT_STEP = mib * coldload.CHUNK_BYTES
                t0 = time.perf_counter()
                stats = coldload.load_entries(list(lay.entries), flat, threads=threads,
                                              direct=False, digest=files)
                if flat.is_cuda:
                    torch.cuda.synchronize(flat.device)
                took = time.perf_counter() - t0
                if r:
                    out[mib].append(lay.nbytes / took / 1e9)
                    hashed[mib].append(stats.hash_seconds)
        print(f"{lay.nbytes / 1e9:.2f} GB into {device}, {threads} threads, {rounds} rounds"
              " in turn")
        for mib in (a, b):
            print(f"HOT_STEP {mib} MiB: GB/s median {statistics.median(out[mib]):.2f}"
                  f" ({', '.join(f'{v:.2f}' for v in out[mib])}); hash seconds summed over"
                  f" threads, median {statistics.median(hashed[mib]):.3f}")


if __name__ == "__main__":
    main()
