"""The parts of a WeightCache that injection reads, with the schema's defaults applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightcache import constants as C
from weightcache.operator.spec import DEFAULT_ENGINE, DEFAULT_RUN_AS


@dataclass(frozen=True)
class CacheView:
    """The parts of a WeightCache that injection reads, with the schema's defaults applied."""

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
    def from_object(cls, obj: dict[str, Any]) -> CacheView:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace", "default")
        engine = {**DEFAULT_ENGINE, **(spec.get("engine") or {})}
        run_as = {**DEFAULT_RUN_AS, **(spec.get("runAs") or {})}
        engine_args = spec.get("engineArgs") or {}
        return cls(
            name=name,
            namespace=namespace,
            runtime=spec.get("runtime") or "native",
            image=spec.get("image") or None,
            socket_dir=spec.get("socketDir") or C.default_socket_dir(namespace, name),
            mode=str(engine["mode"]),
            fallback=bool(engine["fallback"]),
            connect_timeout=float(engine["connectTimeoutSeconds"]),
            state_timeout=float(engine["stateTimeoutSeconds"]),
            uid=int(run_as["uid"]),
            gid=int(run_as["gid"]),
            model_path=(spec.get("model") or {}).get("path"),
            tensor=int((spec.get("parallelism") or {}).get("tensor") or 1),
            dtype=str(engine_args.get("dtype") or "auto"),
            phase=(obj.get("status") or {}).get("phase"),
            quantization=engine_args.get("quantization") or None,
            revision=engine_args.get("revision") or None,
            expert=bool((spec.get("parallelism") or {}).get("expert")),
            extra_args=tuple(str(a) for a in engine_args.get("extraArgs") or ()),
        )
