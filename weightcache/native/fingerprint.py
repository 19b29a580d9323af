"""What a cached shard is, in a form a daemon and an engine can compare field by field.

The checkpoint part hashes only the safetensors headers (names, dtypes, shapes, offsets and
`__metadata__`) keyed by file name, so the same weights copied to another directory still
match, while reading it costs a few kilobytes instead of the whole checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from weightcache import __version__

from .checkpoint import Checkpoint
from .protocol import PROTOCOL_VERSION

RUNTIME_VERSION = f"weightcache-native/{__version__}/protocol-{PROTOCOL_VERSION}"
FIELDS = ("checkpoint", "tp_size", "tp_rank", "dtype", "shard_rules", "aliases", "runtime_version")


def _sha256(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


def checkpoint_hash(ckpt: Checkpoint) -> str:
    return _sha256(ckpt.headers)


def compute(
    ckpt: Checkpoint,
    *,
    tp_size: int,
    tp_rank: int,
    dtype: str,
    shard_rules: list[str] | tuple[str, ...],
    aliases: dict[str, str],
) -> dict[str, Any]:
    return {
        "checkpoint": checkpoint_hash(ckpt),
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "dtype": dtype,
        # At TP=1 no rule changes a byte (every tensor is whole): --no-shard-rules matches.
        "shard_rules": _sha256(list(shard_rules) if tp_size > 1 else []),
        "aliases": _sha256(aliases),
        "runtime_version": RUNTIME_VERSION,
    }


def mismatched_fields(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Fields that differ; a field missing on either side counts as different."""
    if not isinstance(actual, dict):
        return list(FIELDS)
    keys = sorted(set(expected) | set(actual))
    return [k for k in keys if expected.get(k) != actual.get(k)]
