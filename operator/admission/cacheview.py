"""The parts of a WeightCache that injection reads: a thin view of the typed spec.

Every default comes from `weightcache.api.v1alpha1`; the view only flattens the fields the
webhook compares and injects, coerced the way an engine pod's environment needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec


@dataclass(frozen=True)
class CacheView:
    """The parts of a WeightCache that injection reads, with the API's defaults applied."""

    name: str
    namespace: str
    runtime: str
    image: str | None
    socket_dir: str
    mode: str
    fallback: bool
    connect_timeout: float
    state_timeout: float
    uid: int
    gid: int
    model_path: str | None
    tensor: int
    dtype: str
    phase: str | None
    quantization: str | None = None
    revision: str | None = None
    expert: bool = False
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> CacheView:
        meta = obj.get("metadata") or {}
        spec = WeightCacheSpec.from_object(obj)
        engine, run_as, args = spec.engine, spec.run_as, spec.engine_args
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", "default"),
            runtime=spec.runtime or "native",
            image=spec.image or None,
            socket_dir=str(spec.socket_dir),
            mode=str(engine.mode),
            fallback=bool(engine.fallback),
            connect_timeout=float(engine.connect_timeout_seconds),
            state_timeout=float(engine.state_timeout_seconds),
            uid=int(run_as.uid),
            gid=int(run_as.gid),
            model_path=spec.model.path,
            tensor=int(spec.parallelism.tensor or 1),
            dtype=args.effective_dtype,
            phase=(obj.get("status") or {}).get("phase"),
            quantization=args.quantization or None,
            revision=args.revision or None,
            expert=bool(spec.parallelism.expert),
            extra_args=tuple(str(a) for a in args.extra_args or ()),
        )
