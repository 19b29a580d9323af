"""One rank's shard as both sides compute it: where each tensor lives in the arena and the
fingerprint that names it.

The daemon (before it loads) and the client (before it asks, or when it falls back to disk)
call this one function with the same inputs, so a cached shard and an engine's expectation
cannot be computed two ways. Opening the checkpoint and parsing the rules stay with the
callers: the daemon does both before taking its socket lock and importing torch, to refuse bad
input fast.
"""

from __future__ import annotations

from typing import Any

from . import fingerprint as fp
from .checkpoint import DTYPES, Checkpoint, tied_aliases
from .loader import ArenaLayout, dtype_name, plan_layout
from .sharding import ShardRule


def plan_rank_shard(
    ckpt: Checkpoint,
    rules: list[ShardRule],
    *,
    tp_size: int,
    tp_rank: int,
    dtype: str,
    content: Any = None,
) -> tuple[ArenaLayout, dict[str, Any]]:
    """The arena layout of rank `tp_rank`'s shard and its fingerprint (ShardingError if the
    rules cannot split a tensor). `content`: the client's claim (content.sample_claim); the
    daemon fills in its content root once it has digested the files."""
    layout = plan_layout(
        ckpt, rules=rules, tp_size=tp_size, tp_rank=tp_rank, dtype=dtype, aliases=tied_aliases(ckpt)
    )
    fingerprint = fp.compute(
        ckpt,
        tp_size=tp_size,
        tp_rank=tp_rank,
        dtype=served_dtype(layout),
        shard_rules=[r.text for r in rules],
        aliases=layout.aliases,
        content=content,
    )
    return layout, fingerprint


def served_dtype(layout: ArenaLayout) -> str:
    """The fingerprint's `dtype`: what the arena's convertible tensors are, not what was asked.

    `--dtype` converts floating-point tensors wider than a byte and leaves every other one as
    stored (loader.target_dtype), so "auto" and an explicit dtype equal to the checkpoint's
    serve the same bytes and must name the same shard. One dtype when every convertible tensor
    is served in it ("bfloat16"); a checkpoint mixing stored dtypes served as stored ("auto" on
    bf16 weights with f32 norms) is named per stored tag, "BF16:bfloat16,F32:float32", which
    only a request serving the same mix matches; "as-stored" when no tensor is convertible
    (every request serves the same bytes).
    """
    served: dict[str, str] = {}
    for entry in layout.entries:  # per tag once: the torch dtype is looked up by name
        src = entry.source
        if src.tag not in served and src.tag in CONVERTIBLE:
            served[src.tag] = dtype_name(entry.dtype)
    return _name(served)


# safetensors tags `--dtype` converts (loader.target_dtype: floating point, wider than a byte).
CONVERTIBLE = frozenset({"F64", "F32", "F16", "BF16"})


def served_for(tags: set[str] | frozenset[str], dtype: str) -> str:
    """`served_dtype` of a layout whose tensors have these source tags, planned with `dtype`
    (what a daemon answers for another engine's request, without planning it)."""
    return _name({tag: dtype if dtype != "auto" else DTYPES[tag][0]
                  for tag in tags if tag in CONVERTIBLE})


def _name(served: dict[str, str]) -> str:
    kinds = set(served.values())
    if not kinds:
        return "as-stored"
    if len(kinds) == 1:
        return kinds.pop()
    return ",".join(f"{tag}:{name}" for tag, name in sorted(served.items()))
