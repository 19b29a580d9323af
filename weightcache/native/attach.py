"""`weightcache attach`: do what a restarting engine does and report it as one JSON line.

Attach (map the daemon's arena, or fall back to disk), verify (fingerprint and device are
checked by the client; `--verify-bytes` also compares every tensor with the checkpoint), and
print `{"tensors", "bytes", "seconds", "source", "reason", ...}`. Exit 0 when tensors were
obtained, 1 when the cache failed with fallback off (the JSON then has "error"), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from weightcache.contracts.vocabulary import DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache attach", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="safetensors checkpoint directory")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank to attach as")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--device-index", type=int, default=None,
                   help="local device whose socket to use (default: the CUDA device, or on "
                        "CPU the rank; give the local rank for multi-node or DP layouts)")
    p.add_argument("--weight-cache-socket-dir", "--socket-dir", dest="socket_dir", default=None)
    p.add_argument("--socket-path", default=None, help="explicit daemon socket")
    p.add_argument("--mode", choices=("zero_copy", "copy"), default=None)
    fb = p.add_mutually_exclusive_group()
    fb.add_argument("--fallback", dest="fallback", action="store_true", default=None)
    fb.add_argument("--no-fallback", dest="fallback", action="store_false")
    p.add_argument("--shard-rule", action="append", default=None, metavar="REGEX=DIM")
    p.add_argument("--no-shard-rules", action="store_true", help="replicate every tensor")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--connect-timeout-s", type=float, default=None)
    p.add_argument("--state-timeout-s", type=float, default=None)
    p.add_argument("--verify-bytes", action="store_true", help="compare tensors with the disk")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .checkpoint import CheckpointError
    from .client import WeightCacheError, attach, load_from_disk
    from .sharding import ShardingError

    rules = [] if args.no_shard_rules else args.shard_rule
    try:
        result = attach(
            args.model,
            device=args.device,
            tp_size=args.tensor_parallel_size,
            tp_rank=args.rank,
            socket_dir=args.socket_dir,
            socket_path=args.socket_path,
            mode=args.mode,
            fallback=args.fallback,
            connect_timeout_s=args.connect_timeout_s,
            state_timeout_s=args.state_timeout_s,
            shard_rules=rules,
            dtype=args.dtype,
            device_index=args.device_index,
        )
    except (CheckpointError, ShardingError, ValueError) as exc:
        print(json.dumps({"error": "bad_input", "message": str(exc)}))
        return 2
    except WeightCacheError as exc:
        print(json.dumps({"error": exc.reason, "message": str(exc), "source": None}))
        return 1
    except Exception as exc:  # e.g. --device cuda without CUDA: still one JSON line
        print(json.dumps({"error": "internal", "message": f"{type(exc).__name__}: {exc}"}))
        return 1
    summary = result.summary()
    if args.verify_bytes:
        import torch

        from .client import plan_rank

        device = torch.device(args.device)
        plan = plan_rank(
            args.model, device=device,
            device_index=args.device_index if args.device_index is not None
            else device.index if device.index is not None else args.rank,
            tp_size=args.tensor_parallel_size, tp_rank=args.rank, shard_rules=rules,
            dtype=args.dtype,
        )
        disk = load_from_disk(plan.layout, torch.device(args.device))
        bad = [n for n, t in disk.items() if not torch.equal(t, result.state_dict[n])]
        summary["verified"] = not bad
        if bad:
            summary["mismatched_tensors"] = bad[:16]
    print(json.dumps(summary), flush=True)
    return 0 if summary.get("verified", True) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
