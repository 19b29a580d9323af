"""Loading one rank's shard from safetensors files into one flat, aligned buffer.

`plan_layout` decides where every tensor of the rank's shard lives in the arena (aligned
offsets, contiguous strides); `load_into_arena` fills a flat uint8 tensor accordingly. They are
split so that a faster loader (direct I/O, a CUDA staging path) can replace the copy without
touching the layout every other part relies on. `tensors_from_table` turns a flat buffer and
a table back into named tensors and is shared by the daemon's disk path and the client.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch

from weightcache.errors import ProjectError

from .checkpoint import Checkpoint, TensorInfo
from .coldload import LoadStats, load_layout  # parallel reads; pinned + async H2D on CUDA
from .sharding import ShardRule, ShardSpec, plan_shard
from .transport.base import ARENA_ALIGN, align_up

_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
        torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


class ArenaLayoutError(ProjectError, ValueError):
    """A tensor table does not describe valid views of the buffer it comes with."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ArenaLayoutError(f"unknown dtype {name!r}") from None


def target_dtype(source: torch.dtype, dtype: str) -> torch.dtype:
    """`--dtype` converts floating-point tensors only; integer/bool tensors keep theirs."""
    if dtype == "auto" or not source.is_floating_point or source.itemsize == 1:
        return source
    return dtype_from_name(dtype)


class Entry(NamedTuple):
    """One tensor's place in the arena (a named tuple: built per tensor on every attach)."""

    name: str
    source: TensorInfo
    spec: ShardSpec
    dtype: torch.dtype
    offset: int
    nbytes: int

    def row(self) -> dict[str, Any]:
        shape = list(self.spec.shape)
        stride = _contiguous(shape)
        return {
            "name": self.name,
            "dtype": dtype_name(self.dtype),
            "shape": shape,
            "stride": stride,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


def _contiguous(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return list(reversed(stride))


# What `ArenaLayout.digest` hashes; a new encoding gets a new tag (and a protocol version).
LAYOUT_DIGEST = "weightcache-layout/1"


@dataclass(frozen=True)
class ArenaLayout:
    entries: list[Entry]
    aliases: dict[str, str]
    nbytes: int

    def table(self) -> list[dict[str, Any]]:
        return [e.row() for e in self.entries]

    @functools.cached_property
    def _digest_rows(self) -> list[tuple[str, str, tuple[int, ...], int, int]]:
        names: dict[torch.dtype, str] = {}
        rows = []
        for e in self.entries:
            tag = names.get(e.dtype)
            if tag is None:
                tag = names[e.dtype] = dtype_name(e.dtype)
            rows.append((e.name, tag, e.spec.shape, e.offset, e.nbytes))
        return rows

    @functools.cached_property
    def digest(self) -> str:
        """sha256 (hex) of the whole table: every name, dtype, shape, offset and size in
        order, the aliases and the arena size (strides are contiguous by construction).

        What the daemon's `get_state` sends instead of the rows: equal digests mean the
        daemon's arena is laid out exactly as the engine's own plan, at a few bytes on the
        wire whatever the tensor count (a 100,000-tensor table was 11 MB of msgpack)."""
        data = msgpack.packb(
            [LAYOUT_DIGEST, self._digest_rows, sorted(self.aliases.items()), self.nbytes],
            use_bin_type=True)
        return hashlib.sha256(data).hexdigest()

    @functools.cached_property
    def _views(self) -> tuple[list[str], list[tuple[torch.dtype, list[str], list, list, list]]]:
        """The entries' names in order, and per dtype: names, shapes, strides and element
        offsets, computed once per layout (a kept plan reuses them on every attach)."""
        groups: dict[torch.dtype, tuple[list[str], list, list, list]] = {}
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # a checkpoint has few shapes
        for e in self.entries:
            group = groups.get(e.dtype)
            if group is None:
                group = groups[e.dtype] = ([], [], [], [])
            shape = e.spec.shape
            stride = strides.get(shape)
            if stride is None:
                stride = strides[shape] = tuple(_contiguous(list(shape)))
            group[0].append(e.name)
            group[1].append(shape)
            group[2].append(stride)
            group[3].append(e.offset // e.dtype.itemsize)
        return [e.name for e in self.entries], [(d, *g) for d, g in groups.items()]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of `flat` laid out by this layout (our own plan, so no row is checked
        but the size), in the layout's order; aliases map to their target's tensor object.

        One `as_strided` per tensor on a per-dtype view of the arena, mapped in C over the
        precomputed arguments. Grouping equal shapes into one strided tensor and `unbind`
        would be cheaper still, but gives multi-output views, which autograd forbids copying
        a grad-requiring tensor into in place: an engine must get plain views."""
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < self.nbytes:
            raise ArenaLayoutError(f"arena must be a flat uint8 tensor of >= {self.nbytes} bytes")
        size = flat.numel()
        order, groups = self._views
        out: dict[str, torch.Tensor] = {}
        for dtype, names, shapes, strides, starts in groups:
            typed = flat[: size - size % dtype.itemsize].view(dtype)
            out.update(zip(names, map(typed.as_strided, shapes, strides, starts), strict=True))
        if len(groups) > 1:
            out = {name: out[name] for name in order}
        for alias, target in self.aliases.items():
            out[alias] = out[target]
        return out


def plan_layout(
    ckpt: Checkpoint,
    *,
    rules: list[ShardRule],
    tp_size: int,
    tp_rank: int,
    dtype: str = "auto",
    aliases: dict[str, str] | None = None,
) -> ArenaLayout:
    """Place every non-alias tensor of rank `tp_rank` at an ARENA_ALIGN-aligned offset.

    Raises ShardingError when a rule does not divide a tensor by `tp_size`.
    """
    aliases = dict(aliases or {})
    entries: list[Entry] = []
    offset = 0
    # Per safetensors tag: (target dtype, its itemsize, the source's). This runs per tensor
    # on an engine's first attach, so the common cases are written out: at TP=1 every tensor
    # is whole (plan_shard's answer, without the call), and a whole tensor's size follows
    # from the file's.
    targets: dict[str, tuple[torch.dtype, int, int]] = {}
    whole = tp_size == 1
    mask = ARENA_ALIGN - 1
    for name, info in ckpt.tensors.items():
        if name in aliases:
            continue
        shape = info.shape
        if whole:
            spec = ShardSpec(None, 0, shape[0] if shape else 0, shape)
        else:
            spec = plan_shard(name, shape, rules, tp_size, tp_rank)
        target = targets.get(info.tag)
        if target is None:
            out = target_dtype(info.dtype, dtype)
            target = targets[info.tag] = (out, out.itemsize, info.itemsize)
        out, size, source = target
        if spec.dim is None:
            nbytes = info.nbytes // source * size
        else:
            numel = 1
            for d in spec.shape:
                numel *= d
            nbytes = numel * size
        offset = (offset + mask) & ~mask  # align_up(offset, ARENA_ALIGN), a power of two
        entries.append(Entry(name, info, spec, out, offset, nbytes))
        offset += nbytes
    # An alias of a tensor the checkpoint does not hold is dropped rather than dangling.
    names = {e.name for e in entries}
    aliases = {a: t for a, t in aliases.items() if t in names}
    return ArenaLayout(entries, aliases, align_up(offset, ARENA_ALIGN))


def load_into_arena(
    layout: ArenaLayout,
    flat: torch.Tensor,
    *,
    progress: Callable[[int], None] | None = None,
    direct: bool | str | None = None,
    digest: list[Any] | None = None,
    share: bool = False,
    early: Any = None,
) -> LoadStats:
    """Read each tensor's part from its file into `flat` (uint8, at least layout.nbytes).

    One loader for every arena (`coldload`: parallel reads into aligned buffers, pinned on
    CUDA), so a CPU arena gets the same speed and the same guarantees: no file is mapped, so
    a file truncated under the load is an error naming it, never a SIGBUS. `progress(n)` is
    called with the arena bytes of each piece as it is filled; `direct` is the O_DIRECT mode
    (None: `WEIGHTCACHE_LOAD_DIRECT`, default auto); `digest` (the checkpoint's files) makes
    the returned stats carry their content record, from the same pass (with `share`, of the
    chunks this layout reads only: a tensor-parallel rank's record); `early` (an
    `earlyread.EarlyReads`) supplies jobs read while the rank started.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
        raise ArenaLayoutError(f"arena must be a flat uint8 tensor of >= {layout.nbytes} bytes")
    return load_layout(layout, flat, progress=progress, direct=direct, digest=digest,
                       share=share, early=early)


def tensors_from_table(
    flat: torch.Tensor, table: Iterable[dict[str, Any]], aliases: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Named views into `flat`; aliases map to the very same tensor object as their target.

    Every row is checked against the buffer so a bad table raises ArenaLayoutError, never reads
    out of bounds. This runs on every attach (hundreds of rows), so each view is made with
    one `as_strided` on a per-dtype view of the arena instead of a chain of three views.
    """
    size = flat.numel()
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for row in table:
        try:
            name, offset, nbytes = row["name"], row["offset"], row["nbytes"]
            dtype = dtype_from_name(row["dtype"])
            shape, stride = list(row["shape"]), list(row["stride"])
        except (KeyError, TypeError) as exc:
            raise ArenaLayoutError(f"malformed tensor table row {row!r}: {exc}") from None
        if (
            not isinstance(name, str)
            or not isinstance(offset, int) or offset < 0
            or not isinstance(nbytes, int) or nbytes < 0
            or len(stride) != len(shape)
        ):
            raise ArenaLayoutError(f"malformed tensor table row {row!r}")
        numel = 1
        for i in range(len(shape) - 1, -1, -1):  # contiguous strides, checked as they are built
            d, st = shape[i], stride[i]
            if not isinstance(d, int) or not isinstance(st, int) or d < 0 or st < 0:
                raise ArenaLayoutError(f"malformed tensor table row {row!r}")
            if st != numel:
                raise ArenaLayoutError(f"tensor {name!r}: only contiguous strides are supported")
            numel *= max(d, 1)
        itemsize = dtype.itemsize
        if 0 in shape:
            numel = 0
        if numel * itemsize != nbytes or offset + nbytes > size:
            raise ArenaLayoutError(
                f"tensor {name!r}: {nbytes} bytes at {offset} do not fit the arena")
        if offset % itemsize:
            raise ArenaLayoutError(f"tensor {name!r}: offset {offset} is not aligned for {dtype}")
        if name in out:
            raise ArenaLayoutError(f"tensor {name!r} appears twice in the table")
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = flat[: size - size % itemsize].view(dtype)
        out[name] = base.as_strided(shape, stride, offset // itemsize)
    for alias, target in (aliases or {}).items():
        if target not in out or not isinstance(alias, str):
            raise ArenaLayoutError(f"alias {alias!r} points at unknown tensor {target!r}")
        out[alias] = out[target]
    return out
