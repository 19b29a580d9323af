"""The parts of a WeightCache that injection reads: a thin view of the typed spec.

Every default comes from `weightcache.api.v1alpha1`; the view only flattens the fields the
webhook compares and injects, coerced the way an engine pod's environment needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import warmup


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
    max_model_len: int | None = None
    # The node's warmup directory: what is mounted, and what the engine's variables name.
    warmup_dir: str | None = None  # None: spec.warmup.enabled is false
    warmup_env: tuple[tuple[str, str], ...] = ()

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
            max_model_len=args.max_model_len if isinstance(args.max_model_len, int) else None,
            **_warmup(spec, obj),
        )


def _warmup(spec: WeightCacheSpec, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The warmup directory and variables, for the model the group serves now (status.model
    trails spec.model until an update succeeded), as the agent derives them from its plan."""
    if spec.warmup.enabled is not True or not isinstance(spec.warmup.cache_dir, str):
        return {}
    served = (obj.get("status") or {}).get("model") or {}
    if served.get("path"):
        spec = spec.with_model(str(served["path"]), served.get("revision") or None)
    uid = str((obj.get("metadata") or {}).get("uid") or "")
    try:
        root = warmup.identity_dir(spec, uid)
    except (TypeError, ValueError, ZeroDivisionError):
        return {}  # an invalid spec: the operator reports it, nothing is mounted
    return {"warmup_dir": spec.warmup.cache_dir,
            "warmup_env": tuple(warmup.engine_env(spec, root).items())}
