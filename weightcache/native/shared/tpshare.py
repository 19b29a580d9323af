"""The file bytes a tensor-parallel rank reads, from the checkpoint's headers alone (torch-free).

Why: a rank reads its share of the checkpoint only once its layout exists, and the layout has
taken torch (`loader.plan_layout`): seconds of a start with the disk idle. A whole-file rank
(tensor-parallel size 1) reads while it starts (earlyread.py); a tensor-parallel rank could
not, because which bytes are its own followed from the layout. They follow as well from the
headers, the shard rules and the `--dtype` rule, which this module applies without torch.

One rule for every side: `byte_range` is the fill's test of whether a tensor's part is a plain
byte range of its file (`coldload.raw_range`, on the layout's entries), `chunks` the content
chunks a range touches (`coldload.share_chunks`: what a tensor-parallel rank digests and where
its engines' claims sample), and `rank_chunks` the same answer from the headers, so that the
early reads cut exactly the fill's jobs (tests/native/test_tpshare.py holds the two to each
other on random checkpoints).

The ranks of a node share one disk, and a tensor split along an inner dimension is read whole by
each of them (through the page cache, once: `loading.fill`). So a rank reads early only the
chunks no other rank of its group reads (`own_chunks`): each of those is read once whatever
the ranks do, straight from the disk, while the shared ones are left to the fills' buffered
reads, which the page cache lets the ranks share.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .checkpoint import DTYPES, Checkpoint, tied_aliases
from .content import CHUNK_BYTES
from .sharding import ShardRule, ShardSpec, plan_shard

# Tags `--dtype` converts: floating point wider than a byte (loader.target_dtype).
CONVERTIBLE = frozenset(tag for tag, (name, size) in DTYPES.items()
                        if size > 1 and name.startswith(("float", "bfloat")))


def byte_range(offset: int, nbytes: int, shape: tuple[int, ...], itemsize: int,
               spec: ShardSpec, converted: bool) -> tuple[int, int] | None:
    """(file offset, nbytes) where a tensor's part is a plain byte range of its file: kept in
    its dtype, and whole or split along a dimension with nothing outer to it; else None (the
    fill reads the whole tensor and takes the part)."""
    if converted:
        return None
    if spec.dim is None:
        return offset, nbytes
    outer = 1
    for d in shape[: spec.dim]:
        outer *= d
    if outer != 1:
        return None
    inner = itemsize
    for d in shape[spec.dim + 1 :]:
        inner *= d
    return offset + spec.start * inner, spec.length * inner


def chunks(offset: int, nbytes: int) -> range:
    """The content chunks the bytes [offset, offset + nbytes) touch (nbytes > 0)."""
    return range(offset // CHUNK_BYTES, (offset + nbytes - 1) // CHUNK_BYTES + 1)


def converts(tag: str, dtype: str) -> bool:
    """Whether `--dtype dtype` converts a tensor of safetensors tag `tag`."""
    return dtype != "auto" and tag in CONVERTIBLE and DTYPES[tag][0] != dtype


def _parts(ckpt: Checkpoint, rules: list[ShardRule], tp_size: int, dtype: str
           ) -> Iterator[tuple[Path, tuple[int, int], int]]:
    """Per tensor the plan reads: (file, rank 0's byte range, step): rank r reads [offset +
    r * step, + step) where the part is a plain byte range of the file; (file, the whole
    tensor's range, 0) where every rank reads the whole tensor (replicated, split along an
    inner dimension, or converted). Each tensor's rule is matched once, for every rank."""
    aliases = tied_aliases(ckpt)
    for name, info in ckpt.tensors.items():
        if name in aliases or info.nbytes == 0:
            continue
        spec = plan_shard(name, info.shape, rules, tp_size, 0)
        found = byte_range(info.offset, info.nbytes, info.shape, info.itemsize, spec,
                           converts(info.tag, dtype))
        if found is None or spec.dim is None:
            yield Path(info.file), (info.offset, info.nbytes), 0
        else:
            yield Path(info.file), found, found[1]


def rank_chunks(ckpt: Checkpoint, rules: list[ShardRule], tp_size: int, tp_rank: int,
                dtype: str = "auto") -> dict[Path, set[int]]:
    """The content chunks rank `tp_rank` reads, per file: `coldload.share_chunks` of its
    layout's entries (ShardingError where a rule does not divide a tensor)."""
    return own_chunks(ckpt, rules, tp_size, tp_rank, dtype)[0]


def own_chunks(ckpt: Checkpoint, rules: list[ShardRule], tp_size: int, tp_rank: int,
               dtype: str = "auto") -> tuple[dict[Path, set[int]], dict[Path, set[int]]]:
    """(the chunks rank `tp_rank` reads, those of them no other rank of the group reads)."""
    mine: dict[Path, set[int]] = {}
    others: dict[Path, set[int]] = {}
    for path, (offset, nbytes), step in _parts(ckpt, rules, tp_size, dtype):
        if not step:  # every rank reads these bytes
            found = chunks(offset, nbytes)
            mine.setdefault(path, set()).update(found)
            if tp_size > 1:
                others.setdefault(path, set()).update(found)
            continue
        mine.setdefault(path, set()).update(chunks(offset + tp_rank * step, step))
        theirs = others.setdefault(path, set())
        for rank in range(tp_size):
            if rank != tp_rank:
                theirs.update(chunks(offset + rank * step, step))
    own = {path: found - others.get(path, set()) for path, found in mine.items()}
    return mine, {path: found for path, found in own.items() if found}
