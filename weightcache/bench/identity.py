"""Identity section of `weightcache bench`: what exact content identity costs.

The daemon digests every byte it loads (weightcache.native.shared.content) in a thread pool beside
the load; the engine reads a few sampled chunks. Measured on the same checkpoint in the same
run, CPU only (the digest reads the files, not the device copy): the daemon's load alone
(the baseline), load + digest the way the daemon runs them, the digest alone, and the
client's sampled claim against a warm-cache disk load of its shard.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from weightcache.bench.report import add_smoke_flag


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache bench identity")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--small", action="store_true", help="tiny checkpoint (smoke test)")
    add_smoke_flag(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.small, args.repeat = True, 1

    import torch

    from weightcache.bench.native import _median
    from weightcache.bench.report import print_ratios
    from weightcache.native.shared import content
    from weightcache.native.shared.checkpoint import open_checkpoint, tied_aliases
    from weightcache.native.shared.loader import load_into_arena, plan_layout
    from weightcache.native.shared.sharding import parse_rules
    from weightcache.testing.checkpoints import DEMO, TINY, write_llama_checkpoint

    work = Path(tempfile.mkdtemp(prefix="weightcache-bench-identity-"))
    try:
        model = work / "model"
        write_llama_checkpoint(model, TINY if args.small else DEMO, files=2)
        ckpt = open_checkpoint(model)
        layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0,
                             aliases=tied_aliases(ckpt))
        arena = torch.empty(layout.nbytes, dtype=torch.uint8)
        size = sum(f.stat().st_size for f in ckpt.files)

        def load() -> None:
            load_into_arena(layout, arena)

        def load_and_digest() -> None:  # one pass: the loader hashes what it read
            load_into_arena(layout, arena, digest=list(ckpt.files))

        load()  # warm the page cache: both sides of every ratio read from memory
        base = _median(load, args.repeat)
        both = _median(load_and_digest, args.repeat)
        digest = _median(lambda: content.digest_files(ckpt.files), args.repeat)
        claim = _median(lambda: content.sample_claim(ckpt.files), max(args.repeat, 20))
        print_ratios(
            f"daemon load of {size / 2**20:.0f} MiB, with and without the content digest",
            ("load (no digest)", base),
            [("load + digest (one pass, as the daemon runs it)", both),
             ("digest alone (the audit: a separate read)", digest)],
            notes=[f"digest overhead on the load: {100 * (both - base) / base:+.0f}%",
                   f"digest throughput: {size / digest / 2**30:.2f} GiB/s "
                   f"({content.CHUNK_BYTES // 1024} KiB chunks, {content.HASH})"],
        )
        print_ratios(
            "engine: sampled content claim vs. reading its shard from disk (warm cache)",
            ("disk load of the shard", base),
            [("sampled claim (client)", claim)],
            notes=[f"claim reads {content.SAMPLES_TOTAL}+ chunks of "
                   f"{content.CHUNK_BYTES // 1024} KiB"],
        )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
