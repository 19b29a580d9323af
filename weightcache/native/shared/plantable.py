"""A rank's plan as one compact binary table, which the daemon ships to an engine.

An engine's first attach in a process used to parse every header, lay out every tensor and
digest the table (about 8 us per tensor on CPU; most of a 100,000-tensor attach). The daemon
has made exactly that plan already, from files whose bytes the engine can name cheaply: the
raw header bytes (by digest, without parsing them), the index and config.json. So the engine
sends that `plan_key` (`get_plan`), and a daemon whose own key is equal ships its plan, in
chunks of at most CHUNK bytes whatever the tensor count:

- names: one `\\0`-joined UTF-8 blob; `dtype`: one byte per tensor (an index into `dtypes`);
- `offset`, `nbytes`: little-endian int64 per tensor; `ndim`: one byte per tensor, `dims`:
  the shapes' int64 dimensions in order (strides are contiguous by construction);
- `aliases`, the arena size, the layout's digest (`ArenaLayout.digest`, what `get_state`
  answers), the served dtype and, at TP > 1, the content chunks the rank's share reads (where
  the engine's claim samples).

What binds the shipped table to the engine's own files: the key inside it must equal the
engine's (`check_key`): equal header bytes, index, config.json, tensor parallelism, rules and
runtime give the same plan on both sides (`rankplan.plan_rank_shard` is deterministic). The
engine then checks every row against the arena (`ShippedTable.views`: sizes, alignment,
bounds, unique names), so no table can make a view outside the mapping. A daemon could lie
about the layout as well as about the bytes it maps; neither gets past the daemon's own
authentication (security.py), and the content claim still goes with every `get_state`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import sys
from array import array
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import msgpack

from weightcache.errors import ProjectError

PLAN_FORMAT = "weightcache-plan/1"
CHUNK = 4 << 20  # bytes of the table per `get_plan` reply (protocol.MAX_FRAME is 16 MiB)
MAX_PLAN = 1 << 30  # the largest table an engine assembles (about 10M tensors)
KEY_FIELDS = ("checkpoint", "index", "config", "tp_size", "tp_rank", "shard_rules",
              "runtime_version")
MAX_KEY_TEXT = 256
MAX_DTYPE_TEXT = 64


class PlanTableError(ProjectError, ValueError):
    """A shipped table is malformed, or made for other files than the engine's."""


def plan_key(*, checkpoint: str, index: str | None, config: str | None, tp_size: int,
             tp_rank: int, shard_rules: str, runtime_version: str) -> dict[str, Any]:
    """What a plan is made from (`checkpoint`: fingerprint.checkpoint_hash; `index`,
    `config`: sha256 of their raw bytes or None; `shard_rules`: fingerprint.rules_hash)."""
    return {"checkpoint": checkpoint, "index": index, "config": config, "tp_size": tp_size,
            "tp_rank": tp_rank, "shard_rules": shard_rules, "runtime_version": runtime_version}


def key_problem(key: Any) -> str | None:
    """Why a client's key is malformed (None when it is well formed)."""
    if not isinstance(key, dict) or set(key) != set(KEY_FIELDS):
        return f"key must be a map of exactly {', '.join(KEY_FIELDS)}"
    for name, value in key.items():
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            continue
        if not isinstance(value, str) or len(value) > MAX_KEY_TEXT:
            return f"key field {name} must be a short string, an integer or null"
    return None


def mismatched(own: dict[str, Any], key: dict[str, Any]) -> list[str]:
    return [k for k in KEY_FIELDS if own.get(k) != key.get(k)]


def _le(values: array) -> bytes:
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _from_le(data: Any, what: str) -> array:
    if not isinstance(data, bytes) or len(data) % 8:
        raise PlanTableError(f"shipped table: {what} is not an int64 array")
    out = array("q")
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def encode(layout: Any, key: dict[str, Any], served_dtype: str,
           share: dict[str, list[int]] | None) -> bytes | None:
    """The table of `layout` (loader.ArenaLayout) as bytes; None when it cannot be shipped
    (a name holding NUL, more than 255 dimensions): engines then plan themselves."""
    from .loader import dtype_name  # torch: the daemon has it by now

    entries = layout.entries  # named tuples: one C loop per column
    kinds_of = list(map(attrgetter("dtype"), entries))
    codes = {d: i for i, d in enumerate(dict.fromkeys(kinds_of))}
    names = list(map(attrgetter("name"), entries))
    shapes = [e.spec.shape for e in entries]
    ndim = list(map(len, shapes))
    joined = "\0".join(names)
    nul = joined.count("\0") != max(0, len(names) - 1)
    if nul or len(codes) > 256 or (ndim and max(ndim) > 255):
        return None  # a name holding NUL, more than 255 dimensions or dtypes
    kinds = bytes(map(codes.__getitem__, kinds_of))
    ndims = bytes(ndim)
    offsets = array("q", map(attrgetter("offset"), entries))
    sizes = array("q", map(attrgetter("nbytes"), entries))
    dims = array("q", itertools.chain.from_iterable(shapes))
    return msgpack.packb({
        "format": PLAN_FORMAT, "key": key, "served_dtype": served_dtype,
        "count": len(names), "names": joined.encode(),
        "dtypes": [dtype_name(d) for d in codes], "dtype": bytes(kinds),
        "offset": _le(offsets), "nbytes": _le(sizes), "ndim": bytes(ndims), "dims": _le(dims),
        "aliases": dict(layout.aliases), "arena": layout.nbytes,
        "table_digest": layout.digest,
        "share": None if share is None else {f: _le(array("q", sorted(c)))
                                             for f, c in share.items()},
    }, use_bin_type=True)


def digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class ShippedTable:
    """A decoded table: what the cache path needs of a layout (`nbytes`, `aliases`,
    `digest`, `views`), checked row by row when the views are made."""

    names: list[str]
    dtypes: list[str]
    codes: bytes
    offsets: array
    sizes: array
    ndims: bytes
    dims: array
    aliases: dict[str, str]
    nbytes: int
    digest: str  # the daemon's ArenaLayout.digest
    served_dtype: str
    share: dict[str, list[int]] | None

    @property
    def count(self) -> int:
        return len(self.names)

    def _shapes(self) -> list[tuple[int, ...]]:
        """Each tensor's shape; PlanTableError when `dims` does not hold them exactly."""
        dims, ndims = self.dims.tolist(), self.ndims
        if sum(ndims) != len(dims):
            raise PlanTableError("shipped table: dims do not match the shapes")
        if len(set(ndims)) == 1:  # one rank for every tensor (an MoE rank's experts)
            k = ndims[0]
            return list(zip(*[iter(dims)] * k, strict=True)) if k else [()] * len(ndims)
        out, at = [], 0
        for k in ndims:
            out.append(tuple(dims[at:at + k]))
            at += k
        return out

    @functools.cached_property
    def _args(self) -> list[tuple[Any, list[str], list, list, list]]:
        """Per dtype: names, shapes, strides and element offsets, every row checked against
        the arena's size; computed once (a kept plan reuses them on every attach)."""
        from .loader import dtype_from_name  # torch: only an engine makes views

        limit = self.nbytes
        types = [dtype_from_name(d) for d in self.dtypes]
        sizes_of = [t.itemsize for t in types]
        groups: list[tuple[list[str], list, list, list]] = [([], [], [], []) for _ in types]
        known: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        offsets, nbytes = self.offsets.tolist(), self.sizes.tolist()
        for name, shape, code, offset, n in zip(self.names, self._shapes(), self.codes, offsets,
                                                nbytes, strict=True):
            got = known.get(shape)
            if got is None:
                got = known[shape] = _contiguous(shape)
            item = sizes_of[code]
            if got[1] * item != n or offset < 0 or offset % item or offset + n > limit:
                raise PlanTableError(f"shipped table: tensor {name!r} ({n} bytes at {offset})"
                                     f" does not fit the {limit}-byte arena")
            group = groups[code]
            group[0].append(name)
            group[1].append(shape)
            group[2].append(got[0])
            group[3].append(offset // item)
        return [(t, *g) for t, g in zip(types, groups, strict=True) if g[0]]

    def views(self, flat: Any) -> dict[str, Any]:
        """Named views of `flat` (uint8, >= nbytes), aliases the same objects as their target;
        PlanTableError for any row that is not a contiguous tensor inside the arena."""
        import torch

        size = flat.numel()
        if flat.dtype != torch.uint8 or flat.dim() != 1 or size < self.nbytes:
            raise PlanTableError(f"arena must be a flat uint8 tensor of >= {self.nbytes} bytes")
        groups = self._args
        out: dict[str, Any] = {}
        for dtype, names, shapes, strides, starts in groups:
            typed = flat[: size - size % dtype.itemsize].view(dtype)
            out.update(zip(names, map(typed.as_strided, shapes, strides, starts), strict=True))
        if len(groups) > 1:
            out = {name: out[name] for name in self.names}
        for alias, target in self.aliases.items():
            out[alias] = out[target]
        return out


def _contiguous(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(contiguous strides, element count) of `shape`; PlanTableError for a negative one."""
    stride, acc = [], 1
    for d in reversed(shape):
        if d < 0:
            raise PlanTableError(f"shipped table: negative dimension in {shape}")
        stride.append(acc)
        acc *= max(d, 1)
    numel = 0 if 0 in shape else acc
    return tuple(reversed(stride)), numel


def decode(blob: bytes, key: dict[str, Any]) -> ShippedTable:
    """The table in `blob`, refused (PlanTableError) unless it is well formed and made for
    `key` (the engine's own, `plan_key`; the daemon checked the dtype asked for)."""
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True,
                              ext_hook=_no_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise PlanTableError(f"shipped table is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != PLAN_FORMAT:
        raise PlanTableError("shipped table has another format")
    own = obj.get("key")
    if not isinstance(own, dict) or mismatched(own, key):
        raise PlanTableError("the shipped table was made for other files or another shard")
    count, names_blob = obj.get("count"), obj.get("names")
    codes, ndims, dtypes = obj.get("dtype"), obj.get("ndim"), obj.get("dtypes")
    if (not isinstance(count, int) or not isinstance(names_blob, bytes)
            or not isinstance(codes, bytes) or not isinstance(ndims, bytes)
            or not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes)):
        raise PlanTableError("shipped table: malformed fields")
    try:
        names = names_blob.decode().split("\0") if count else []
    except UnicodeDecodeError:
        raise PlanTableError("shipped table: names are not UTF-8") from None
    offsets, sizes = _from_le(obj.get("offset"), "offset"), _from_le(obj.get("nbytes"), "nbytes")
    dims = _from_le(obj.get("dims"), "dims")
    if not count == len(names) == len(codes) == len(ndims) == len(offsets) == len(sizes):
        raise PlanTableError("shipped table: its columns differ in length")
    if len(set(names)) != count:
        raise PlanTableError("shipped table: a tensor appears twice")
    if codes and max(codes) >= len(dtypes):
        raise PlanTableError("shipped table: unknown dtype index")
    aliases, arena, table_digest = obj.get("aliases"), obj.get("arena"), obj.get("table_digest")
    served = obj.get("served_dtype")
    if (not isinstance(aliases, dict) or not isinstance(arena, int) or arena < 0
            or not isinstance(table_digest, str) or not isinstance(served, str)):
        raise PlanTableError("shipped table: malformed fields")
    named = set(names)
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in named or alias in named:
            raise PlanTableError(f"shipped table: alias {str(alias)[:80]!r} is not an alias")
    share = obj.get("share")
    if share is not None:
        if not isinstance(share, dict):
            raise PlanTableError("shipped table: malformed share")
        share = {f: list(_from_le(c, "share")) for f, c in share.items()}
    if (key.get("tp_size") != 1) != (share is not None):
        raise PlanTableError("shipped table: a share is sent exactly at TP > 1")
    return ShippedTable(names, dtypes, codes, offsets, sizes, ndims, dims, aliases, arena,
                        table_digest, served, share)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of this protocol")
