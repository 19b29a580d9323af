"""Tensor-parallel sharding rules: which tensors are split along which dimension.

A rule is `REGEX=DIM`; the first rule whose regex matches a tensor name (`re.search`) decides
the dimension the tensor is split along, in TP equal parts, rank r taking part r. Tensors that
match no rule are replicated. The rules are part of the fingerprint, so a daemon and an engine
that shard differently never share a table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from weightcache.errors import ProjectError

# Llama-family (Llama, Mistral, Qwen2 naming): column-parallel projections split the output
# dim (0), row-parallel ones the input dim (1), the vocabulary is split by rows.
LLAMA_PRESET: tuple[str, ...] = (
    r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$=0",
    r"\.(o_proj|down_proj)\.weight$=1",
    r"(^|\.)embed_tokens\.weight$=0",
    r"(^|\.)lm_head\.weight$=0",
)


class ShardingError(ProjectError, ValueError):
    """A shard rule is malformed, or it cannot split a tensor evenly across TP ranks."""


@dataclass(frozen=True)
class ShardRule:
    text: str
    pattern: re.Pattern[str]
    dim: int


def parse_rule(text: str) -> ShardRule:
    regex, sep, dim = text.rpartition("=")
    if not sep or not regex:
        raise ShardingError(f"shard rule {text!r} must look like REGEX=DIM")
    try:
        dim_value = int(dim)
    except ValueError:
        raise ShardingError(f"shard rule {text!r}: dim {dim!r} is not an integer") from None
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise ShardingError(f"shard rule {text!r}: bad regex: {exc}") from None
    return ShardRule(text, pattern, dim_value)


def parse_rules(texts: list[str] | tuple[str, ...] | None) -> list[ShardRule]:
    """None means the built-in Llama preset; an empty list means replicate everything."""
    return [parse_rule(t) for t in (LLAMA_PRESET if texts is None else texts)]


def shard_dim(name: str, rules: list[ShardRule]) -> int | None:
    for rule in rules:
        if rule.pattern.search(name):
            return rule.dim
    return None


class ShardSpec(NamedTuple):
    """Where rank `tp_rank`'s part of a tensor lives: dim, start, length (None: replicated).

    A named tuple: one is built per tensor on every attach."""

    dim: int | None
    start: int
    length: int
    shape: tuple[int, ...]  # the shape of this rank's part


def plan_shard(
    name: str, shape: tuple[int, ...], rules: list[ShardRule], tp_size: int, tp_rank: int
) -> ShardSpec:
    dim = None if tp_size == 1 else shard_dim(name, rules)  # one rank: no rule can apply
    if dim is None:
        return ShardSpec(None, 0, shape[0] if shape else 0, shape)
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ShardingError(
            f"tensor {name!r} has shape {list(shape)}; shard rule dim {dim} is out of range"
        )
    dim %= ndim
    if shape[dim] % tp_size:
        raise ShardingError(
            f"tensor {name!r}: dim {dim} of shape {list(shape)} ({shape[dim]}) is not divisible"
            f" by tensor-parallel-size {tp_size}"
        )
    part = shape[dim] // tp_size
    new_shape = list(shape)
    new_shape[dim] = part
    return ShardSpec(dim, tp_rank * part, part, tuple(new_shape))
