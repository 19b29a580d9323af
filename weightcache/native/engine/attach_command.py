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

from weightcache.cliformat import HelpFormatter
from weightcache.contracts.vocabulary import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK

from ..shared.checkpoint import CheckpointError
from ..shared.errors import WeightCacheError
from ..shared.flags import add_shard_flags, shard_rules
from ..shared.sharding import ShardingError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache attach", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    add_shard_flags(p, model_help="local directory of .safetensors files (the daemon's --model)",
                    tp_help="tensor-parallel size the daemon was started with",
                    dtype_help="the daemon's --dtype",
                    rules_help="the daemon's shard rules (repeatable; default: the Llama preset)")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank to attach as")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--device-index", type=int, default=None,
                   help="local device whose socket to use (default: the CUDA device, or on "
                        "CPU the rank; give the local rank for multi-node or DP layouts)")
    p.add_argument("--weight-cache-socket-dir", "--socket-dir", dest="socket_dir", default=None,
                   help="the daemon's socket directory (default: $WEIGHTCACHE_SOCKET_DIR, "
                        "else the private per-user dir under the temp dir)")
    p.add_argument("--socket-path", default=None,
                   help="explicit daemon socket (default: derived from the directory and the "
                        "device's identity)")
    p.add_argument("--mode", choices=("zero_copy", "copy"), default=None,
                   help="zero_copy maps the daemon's arena (shared, nothing is freed); copy "
                        "clones it and then RELEASES the cache: the daemon frees its arena and "
                        "every later engine on this device loads from disk (docs/native.md). "
                        "Default: $WEIGHTCACHE_MODE, else zero_copy")
    fb = p.add_mutually_exclusive_group()
    fb.add_argument("--fallback", dest="fallback", action="store_true", default=None,
                    help="load from disk when the cache cannot serve (default: "
                         "$WEIGHTCACHE_FALLBACK, else on)")
    fb.add_argument("--no-fallback", dest="fallback", action="store_false",
                    help="fail (exit 1) instead of loading from disk")
    p.add_argument("--connect-timeout-s", type=float, default=None,
                   help="seconds to connect and get hello (default: "
                        "$WEIGHTCACHE_CONNECT_TIMEOUT_S, else 5)")
    p.add_argument("--state-timeout-s", type=float, default=None,
                   help="seconds to get the tensor table and arena (default: "
                        "$WEIGHTCACHE_STATE_TIMEOUT_S, else 300)")
    p.add_argument("--verify-bytes", action="store_true", help="compare tensors with the disk")
    return p


def _fail(code: int, error: str, message: str) -> int:
    """One JSON line on stdout (for scripts) and the same message as one line on stderr."""
    print(json.dumps({"error": error, "message": message, "source": None}), flush=True)
    print(f"weightcache attach: {message}", file=sys.stderr)
    return code


def _cuda_problem(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    import torch  # --device cuda only; attach() imports it anyway, after the usage checks

    if not torch.cuda.is_available():
        return (f"--device {device}: no CUDA device is visible here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device"
                " cpu, or check the NVIDIA driver and CUDA_VISIBLE_DEVICES")
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .attach import attach, load_from_disk  # torch: after --help and usage errors

    rules = shard_rules(args)
    try:
        problem = _cuda_problem(args.device)
    except RuntimeError as exc:  # a malformed device string
        problem = f"--device {args.device}: {exc}"
    if problem:
        return _fail(EXIT_BAD_INPUT, "bad_input", problem)
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
        return _fail(EXIT_BAD_INPUT, "bad_input", str(exc))
    except WeightCacheError as exc:
        return _fail(EXIT_ERROR, exc.reason, str(exc))
    except Exception as exc:  # a bug, not the user's input: still one line, never a traceback
        return _fail(EXIT_ERROR, "internal", f"{type(exc).__name__}: {exc}")
    summary = result.summary()
    if args.verify_bytes:
        import torch  # attach() imported it already

        from .attach import plan_rank

        device = torch.device(args.device)
        plan = plan_rank(
            args.model, device=device,
            device_index=args.device_index if args.device_index is not None
            else device.index if device.index is not None else args.rank,
            tp_size=args.tensor_parallel_size, tp_rank=args.rank, shard_rules=rules,
            dtype=args.dtype, cache=False,  # planned from the files, whatever was kept
        )
        disk = load_from_disk(plan.layout, torch.device(args.device))
        bad = [n for n, t in disk.items() if not torch.equal(t, result.state_dict[n])]
        summary["verified"] = not bad
        if bad:
            summary["mismatched_tensors"] = bad[:16]
    print(json.dumps(summary), flush=True)
    return EXIT_OK if summary.get("verified", True) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
