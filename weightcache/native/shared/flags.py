"""The flags that name a rank's shard, declared once for `weightcache preload`, its daemon ranks
and `weightcache attach`.

An engine hits the cache only if it asks for the shard the daemon holds (`--model`,
`--tensor-parallel-size`, `--dtype` and the shard rules are all in the fingerprint), so the
three commands must spell and parse them the same way: each adds them with `add_shard_flags`
and reads them back with `shard_rules`.
"""

from __future__ import annotations

import argparse

from weightcache.contracts.layout import TENSOR_FLAG
from weightcache.contracts.vocabulary import DTYPES


def add_shard_flags(parser: argparse.ArgumentParser, *, model_help: str, tp_help: str | None,
                    dtype_help: str, rules_help: str) -> None:
    """`--model`, `--tensor-parallel-size`/`-tp`, `--dtype`, `--shard-rule`, `--no-shard-rules`;
    the help texts say what each means for the command at hand. `tp_help=None`: the command
    declares the TP size with the rest of the parallel layout (`contracts.layout.Layout`)."""
    parser.add_argument("--model", required=True, help=model_help)
    if tp_help is not None:
        parser.add_argument(TENSOR_FLAG, "-tp", type=int, default=1, help=tp_help)
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=dtype_help)
    parser.add_argument("--shard-rule", action="append", default=None, metavar="REGEX=DIM",
                        help=rules_help)
    parser.add_argument("--no-shard-rules", action="store_true", help="replicate every tensor")


def shard_rules(args: argparse.Namespace) -> list[str] | None:
    """The rules as `sharding.parse_rules` takes them: None for the preset, [] for none."""
    return [] if args.no_shard_rules else args.shard_rule


def shard_argv(model: str, tp_size: int, dtype: str, rules: list[str] | None) -> list[str]:
    """The same flags as argv, for a command that starts another (the launcher's ranks)."""
    argv = ["--model", model, TENSOR_FLAG, str(tp_size), "--dtype", dtype]
    if rules is not None and not rules:
        argv.append("--no-shard-rules")
    for rule in rules or []:
        argv += ["--shard-rule", rule]
    return argv


def add_allow_uid_flag(parser: argparse.ArgumentParser) -> None:
    """`--weight-cache-allow-uid`, one name from `weightcache preload` down to its ranks."""
    parser.add_argument("--weight-cache-allow-uid", dest="allow_uid", metavar="UID", type=int,
                        action="append",
                        default=[], help="also accept clients running as this uid (repeatable)")
