"""Loading one rank's shard from safetensors files into one flat, aligned buffer.

`plan_layout` decides where every tensor of the rank's shard lives in the arena (aligned
offsets, contiguous strides); `load_into_arena` fills a flat uint8 tensor accordingly. They are
split so that a faster loader (direct I/O, a CUDA staging path) can replace the copy without
touching the layout every other part relies on. `tensors_from_table` turns a flat buffer and
a table back into named tensors and is shared by the daemon's disk path and the client.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from weightcache.errors import ProjectError

from .checkpoint import Checkpoint, TensorInfo
from .coldload import copy_entry, load_layout  # CUDA: pinned, multi-threaded reads + H2D
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


@dataclass(frozen=True)
class Entry:
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


@dataclass(frozen=True)
class ArenaLayout:
    entries: list[Entry]
    aliases: dict[str, str]
    nbytes: int

    def table(self) -> list[dict[str, Any]]:
        return [e.row() for e in self.entries]


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
    targets: dict[str, torch.dtype] = {}  # per safetensors tag: this runs on every attach
    for name, info in ckpt.tensors.items():
        if name in aliases:
            continue
        spec = plan_shard(name, info.shape, rules, tp_size, tp_rank)
        out = targets.get(info.tag)
        if out is None:
            out = targets[info.tag] = target_dtype(info.dtype, dtype)
        numel = 1
        for d in spec.shape:
            numel *= d
        nbytes = numel * out.itemsize
        offset = align_up(offset, ARENA_ALIGN)
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
) -> Any:
    """Copy each tensor's part from its file into `flat` (uint8, at least layout.nbytes).

    `progress(n)` is called with the arena bytes of each piece as it is filled. On CUDA the
    cold loader's `LoadStats` is returned (None on the CPU path); `direct` is its O_DIRECT
    mode (None: `WEIGHTCACHE_LOAD_DIRECT`, default auto).
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
        raise ArenaLayoutError(f"arena must be a flat uint8 tensor of >= {layout.nbytes} bytes")
    if flat.is_cuda:
        return load_layout(layout, flat, progress=progress, direct=direct)
    by_file: dict[Any, list[Entry]] = {}
    for entry in layout.entries:
        by_file.setdefault(entry.source.file, []).append(entry)
    for path, entries in by_file.items():
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size == 0:
                continue
            filemap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            for entry in entries:
                if entry.nbytes == 0:
                    continue
                info = entry.source
                raw = torch.frombuffer(filemap, dtype=torch.uint8, count=info.nbytes,
                                       offset=info.offset)
                copy_entry(raw, entry, flat[entry.offset : entry.offset + entry.nbytes])
                del raw
                if progress is not None:
                    progress(entry.nbytes)
        finally:
            with contextlib.suppress(BufferError):
                filemap.close()
    return None


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
