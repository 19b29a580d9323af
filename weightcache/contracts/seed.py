"""Seeding new replicas through vLLM's seed flags: who may seed whom, and where the token lives
(docs/warmup.md, "Seeding new replicas").

One module for the operator (which picks the source, owns the token Secret and writes each
node's peer into the plan) and the agent (which turns that into `vllm preload`'s
`--seed-*` flags and its `--config` file). vLLM 0.33's protocol (preload.py,
weight_cache/seed.py, warmup_cache.py): each daemon listens on, or dials,
`base_port + group_index * world_size + global_rank`; a source answers only a request with
the same config hash, DP rank and world rank, so a peer must be a cache of the same model,
engine arguments, image and launched layout; node rank r of the target dials node rank r of
the source (same ranks, same ports).
"""

from __future__ import annotations

from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import warmup

# The key of the operator's token Secret (`constants.seed_secret_name(source)`), and where
# agent pods mount it read-only (outside /etc/weightcache, the plan's mount).
TOKEN_KEY = "token"
TOKEN_DIR = "/etc/weightcache-seed"
TOKEN_PATH = f"{TOKEN_DIR}/{TOKEN_KEY}"
TOKEN_BYTES = 32
# vLLM offsets a draft group's ports by one world size after the target block.
MAX_GROUPS = 2


def not_applicable(spec: WeightCacheSpec) -> str | None:
    """Why this cache passes no seed flags at all (None: it seeds or serves seeds)."""
    if spec.runtime != "vllm":
        return "seeding applies to runtime vllm only"
    if spec.warmup.enabled is not True:
        return "spec.warmup.enabled is false"
    if spec.warmup.seed.enabled is not True:
        return "spec.warmup.seed.enabled is false"
    if spec.launched_layout().world_size == 1:
        # flashinfer_autotune_cache.use_flashinfer_autotune_v2: world size 1 tunes into
        # FlashInfer's v2 store, and the seed source serves only the v1 per-rank file.
        return ("vLLM 0.33 seeds only daemons of world size > 1 (a single-GPU daemon tunes "
                "into FlashInfer's v2 store, which its seed channel does not carry)")
    return None


def port_block(spec: WeightCacheSpec) -> int:
    """How many ports from `ports.seed` the daemons of one node may use (an upper bound:
    whether a draft group exists is known only from the draft checkpoint)."""
    groups = MAX_GROUPS if spec.engine_args.speculative_config else 1
    return groups * spec.launched_layout().world_size


def mismatch(source: WeightCacheSpec, target: WeightCacheSpec) -> str | None:
    """What differs between two caches that vLLM's seed key depends on (None: peers)."""
    a, b = warmup.compiled_for(source), warmup.compiled_for(target)
    for key in ("runtime", "image", "model", "engineArgs", "layout"):
        if a.get(key) != b.get(key):
            return f"{key} differs ({_short(a.get(key))} vs {_short(b.get(key))})"
    return None


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."
