"""What a cached shard is, in a form a daemon and an engine can compare field by field.

The `checkpoint` part hashes the safetensors headers (names, dtypes, shapes, offsets and
`__metadata__`) keyed by file name. Headers say nothing about values, so the `content` part
carries the bytes' identity (weightcache.native.shared.content): on the daemon's side the full
content digest of what it loaded, on the client's side a claim (file identities plus sampled
chunk digests) that the daemon checks against its per-chunk record. Both are keyed by file
name, so the same weights copied to another directory still match.

The set of keys is fixed (FIELDS) and every value bounded: a client cannot grow the daemon's
state or its `stats` with keys of its own (`validate`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from weightcache import __version__

from . import content as content_mod
from .checkpoint import Checkpoint
from .protocol import PROTOCOL_VERSION

RUNTIME_VERSION = f"weightcache-native/{__version__}/protocol-{PROTOCOL_VERSION}"
FIELDS = ("checkpoint", "tp_size", "tp_rank", "dtype", "shard_rules", "aliases", "runtime_version",
          "content")
MAX_TEXT = 256  # every field but `content` is a short string or an integer


def _sha256(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


def checkpoint_hash(ckpt: Checkpoint) -> str:
    """The headers' identity: the digests of their raw bytes, by file name.

    Re-serialising the parsed headers cost microseconds per tensor on every attach; the raw
    bytes name the same header at least as strictly (a header that parses equal but is written
    differently only misses). A Checkpoint built without raw digests hashes its headers."""
    if ckpt.header_digests and set(ckpt.header_digests) == set(ckpt.headers):
        return raw_checkpoint_hash(ckpt.header_digests)
    return _sha256(ckpt.headers)


def raw_checkpoint_hash(header_digests: dict[str, str]) -> str:
    """`checkpoint_hash` from the raw header digests alone (`checkpoint.read_raw`)."""
    return _sha256({"raw_sha256": header_digests})


def rules_hash(shard_rules: list[str] | tuple[str, ...], tp_size: int) -> str:
    """The fingerprint's `shard_rules`: at TP=1 no rule changes a byte (every tensor is
    whole), so --no-shard-rules matches."""
    return _sha256(list(shard_rules) if tp_size > 1 else [])


def aliases_hash(aliases: dict[str, str]) -> str:
    return _sha256(aliases)


def compute(
    ckpt: Checkpoint,
    *,
    tp_size: int,
    tp_rank: int,
    dtype: str,
    shard_rules: list[str] | tuple[str, ...],
    aliases: dict[str, str],
    content: Any,
) -> dict[str, Any]:
    """`content`: the daemon's content root (str) or the client's claim (map)."""
    return {
        "checkpoint": checkpoint_hash(ckpt),
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "dtype": dtype,
        "shard_rules": rules_hash(shard_rules, tp_size),
        "aliases": aliases_hash(aliases),
        "runtime_version": RUNTIME_VERSION,
        "content": content,
    }


def validate(actual: Any) -> str | None:
    """Why a client-supplied fingerprint is malformed (None when it is well formed)."""
    if not isinstance(actual, dict):
        return "fingerprint must be a map"
    unknown = [k for k in actual if k not in FIELDS]
    if unknown:
        return f"fingerprint has {len(unknown)} unknown key(s), e.g. {str(unknown[0])[:64]!r}"
    for key, value in actual.items():
        if key == "content":
            continue  # checked by content.verify_claim
        if isinstance(value, str):
            if len(value) > MAX_TEXT:
                return f"fingerprint field {key} is longer than {MAX_TEXT} characters"
        elif not isinstance(value, int) or isinstance(value, bool):
            return f"fingerprint field {key} must be a string or an integer"
    return None


def mismatched_fields(
    expected: dict[str, Any],
    actual: dict[str, Any],
    record: dict[str, content_mod.FileDigest] | None = None,
    *,
    claim_later: bool = False,
) -> dict[str, str]:
    """Fields that differ, each with why (in order of FIELDS; empty when they all match); a
    field missing on either side counts as different.

    With the daemon's per-file `record`, `content` is the client's claim, checked by
    content.verify_claim (once: its answer is the reason); without it the two `content`
    values are compared as they are. `claim_later`: a copy-mode engine's claim comes after
    its copy (`check_claim`), so `content` is not compared here. `dtype` names what each side
    serves (rankplan.served_dtype).
    """
    if not isinstance(actual, dict):
        return {k: "" for k in FIELDS}
    out: dict[str, str] = {}
    for k in FIELDS:
        if k == "content" and claim_later:
            continue
        if k == "content" and record is not None:
            why = content_mod.verify_claim(record, actual.get(k))
            if why is not None:
                out[k] = why
        elif expected.get(k) != actual.get(k):
            out[k] = ""
            if k == "dtype":
                out[k] = (f"the cache serves {str(expected.get(k))[:MAX_TEXT]},"
                          f" this load asks for {str(actual.get(k))[:MAX_TEXT]}")
    return out


def describe(fields: dict[str, str]) -> str:
    """`mismatched_fields`' answer as one line: "dtype (the cache serves ...), content (...)"."""
    return ", ".join(f"{k} ({why})" if why else k for k, why in fields.items())
