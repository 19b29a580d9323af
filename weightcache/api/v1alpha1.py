"""The WeightCache API, `weightcache.io/v1alpha1`, as typed Python: every field, every default.

Each spec field is a dataclass field whose metadata carries what the CRD's OpenAPI schema
says of it (description, enum, bounds, pattern); `weightcache.api.schema` generates the
schema from these classes, so a default or a bound is written here once and the CRD, the
operator, the webhook and the agent all read it from here (the way kubebuilder markers sit on
Go API structs).

`WeightCacheSpec.from_spec(raw, namespace, name)` parses a spec once: every default is filled,
including the ones that depend on other fields (the model volume from `mountPath`,
`parallelism.dataLocal` and `gpusPerNode` from the layout, `socketDir` from the namespace and
name, `ports.draftRendezvous` from `ports.rendezvous`). Values the user wrote are kept as
written, even when they are invalid (an explicit null counts as absent), so that
`weightcache.operator.spec.validate` can name the
user's own field; read the typed values as typed only after validation found nothing. A
nested object the user wrote as something else (a string where an object belongs) is kept in
`malformed` and its field takes the defaults. `to_dict()` gives the camelCase document back
(what the plan and the tests compare).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from weightcache import constants
from weightcache.contracts import vocabulary
from weightcache.contracts.layout import Layout

# Bounds that keep every owned object within the API server's limits: the plan ConfigMap
# under 1 MiB and the DaemonSet (one node-affinity term per node) far under etcd's 1.5 MiB
# request limit, even with 253-character node names (tests/operator/test_apirules.py).
MAX_NODES = 256
MAX_GPUS_PER_NODE = 64
UPDATE_STRATEGIES = ("InPlace", "Recreate")
DEFAULT_DTYPE = "auto"
SHARD_RULE_PATTERN = "^.+=-?[0-9]+$"
PIPELINE_MESSAGE = (
    "pipeline parallelism is not supported: remove spec.parallelism.pipeline or set it to 1"
)


def prop(
    description: str,
    *,
    kind: str,
    default: Any = dataclasses.MISSING,
    factory: Any = dataclasses.MISSING,
    implied: Any = None,
    schema_default: bool = True,
    items: Any = None,
    **schema: Any,
) -> Any:
    """A spec field: its Python default and what the OpenAPI schema says of it.

    `kind` is the schema type (`string`, `integer`, `number`, `boolean`, `object`, `array`,
    `free` for a core/v1 type kept verbatim, `labels` for a string map); `items` the item
    kind of an array. A constant default enters the schema as `default:` unless
    `schema_default` is False (defaults that depend on the runtime or on other fields, and
    empty collections, which mean the same as absence).

    `implied` is a default that a parsed document leaves as None (so a reader can tell "the
    engine's own default" from a stated value) but that every rendered document and the
    schema state.
    """
    metadata = {
        "description": description,
        "kind": kind,
        "items": items,
        "schema": schema,
        "implied": implied,
        "schema_default": schema_default and (
            implied is not None or (default is not dataclasses.MISSING and default is not None)
        ),
    }
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=None if default is dataclasses.MISSING else default, metadata=metadata)


def child(cls: type) -> Any:
    """A nested object field, defaulting to the object with every default (its schema
    description is the class's `DESCRIPTION`)."""
    return field(default_factory=cls, metadata={"kind": "object", "class": cls})


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class _Object:
    """Generic parsing and rendering of the API dataclasses (camelCase on the wire)."""

    # CEL rules of this object (x-kubernetes-validations), for the schema.
    VALIDATIONS: ClassVar[tuple[dict[str, str], ...]] = ()
    # Fields the schema requires.
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    DESCRIPTION: ClassVar[str] = ""

    @classmethod
    def raw_values(cls, raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(constructor keywords, malformed nested values) of a camelCase mapping; absent
        fields are left out so their defaults apply."""
        values: dict[str, Any] = {}
        malformed: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            key = camel(f.name)
            # An explicit null means absent, as the API server treats it (it prunes nulls of
            # fields that are not nullable before defaulting).
            if f.name == "malformed" or raw.get(key) is None:
                continue
            value = raw[key]
            nested = f.metadata.get("class")
            if nested is not None:
                if isinstance(value, Mapping):
                    values[f.name] = nested.from_raw(value)
                else:
                    malformed[key] = value
            else:
                values[f.name] = _copy(value)
        return values, malformed

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Any:
        values, _ = cls.raw_values(raw)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The camelCase object; fields without a value (None) are left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "malformed":
                continue
            value = getattr(self, f.name)
            if isinstance(value, _Object):
                value = value.to_dict()
            if value is None:
                value = f.metadata.get("implied")
            if value is None:
                continue
            out[camel(f.name)] = _copy(value)
        for key, value in getattr(self, "malformed", {}).items():
            out[key] = _copy(value)
        return out


def _copy(value: Any) -> Any:
    """A deep copy of plain JSON-like data, so a parsed spec never shares the caller's lists."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _int(value: Any, default: int) -> int:
    """`value` when it is an integer, else `default`: derived defaults are computed from the
    user's values only when those are usable, and validation reports the rest."""
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return value


@dataclass(frozen=True)
class Model(_Object):
    DESCRIPTION = (
        "Where the checkpoint lives. The agent mounts `volume` at `mountPath` and loads `path`."
    )
    REQUIRED = ("path",)

    path: str | None = prop(
        "Checkpoint directory inside the mounted volume (absolute, under mountPath), "
        "e.g. /models/llama-3.1-8b.",
        kind="string", minLength=1,
    )
    mount_path: str = prop(
        "Where the model volume is mounted in the agent container.",
        kind="string", default="/models", pattern="^/",
    )
    volume: dict[str, Any] | None = prop(
        "Any core/v1 volume source holding the checkpoint, e.g. {hostPath: {path: "
        "/models, type: Directory}} or {persistentVolumeClaim: {claimName: models, "
        "readOnly: true}}. Default: the node's directory at mountPath.",
        kind="free",
    )
    revision: str | None = prop(
        "A label for the checkpoint's revision (e.g. a training step). Changing it, or "
        "path, moves the cache to the new revision as updateStrategy says; reported "
        "per node in status.",
        kind="string",
    )

    @staticmethod
    def default_volume(mount_path: str) -> dict[str, Any]:
        """Without a volume the checkpoint is read from the same path on the node."""
        return {"hostPath": {"path": mount_path, "type": "Directory"}}


@dataclass(frozen=True)
class EngineArgs(_Object):
    DESCRIPTION = (
        "Engine arguments passed through to the daemon. They enter the weight fingerprint, so "
        "they must equal the engines' own flags; the webhook warns about mismatches."
    )

    # None: not stated, so the vllm runtime passes no --dtype (vLLM's own default is auto).
    dtype: str | None = prop("Weight dtype (--dtype).", kind="string",
                             enum=list(vocabulary.DTYPES), implied=DEFAULT_DTYPE)
    quantization: str | None = prop("Quantization method (--quantization), e.g. fp8.",
                                    kind="string")
    revision: str | None = prop("Model revision (--revision): branch, tag or commit.",
                                kind="string")
    max_model_len: int | None = prop("Maximum model context length (--max-model-len).",
                                     kind="integer", minimum=1)
    speculative_config: dict[str, Any] | None = prop(
        "Speculative decoding config (vLLM --speculative-config JSON); MTP, EAGLE and "
        "EAGLE3 drafts get their own daemon group on ports.draftRendezvous.",
        kind="free",
    )
    extra_args: list[str] = prop("Further daemon arguments, one token per item.",
                                 kind="array", items="string", factory=list)

    @property
    def effective_dtype(self) -> str:
        """The dtype the weights are loaded in: the stated one, else the implied default."""
        return str(self.dtype or DEFAULT_DTYPE)


@dataclass(frozen=True)
class Parallelism(_Object):
    DESCRIPTION = "The engines' parallel layout; the daemons shard the weights exactly like it."
    VALIDATIONS = (
        {"rule": "!has(self.pipeline) || self.pipeline == 1", "message": PIPELINE_MESSAGE},
    )

    tensor: int = prop("Tensor-parallel size (global).", kind="integer", minimum=1, default=1)
    pipeline: int = prop(
        "Pipeline-parallel size: must be absent or 1 (the daemon rejects pipeline "
        "parallelism).",
        kind="integer", minimum=1, maximum=1, default=1, schema_default=False,
    )
    data: int = prop("Data-parallel size (global).", kind="integer", minimum=1, default=1)
    data_local: int | None = prop(
        "Data-parallel ranks per node (--data-parallel-size-local). Default: "
        "tensor*data/nodes/tensor when a node holds whole TP groups, else 1.",
        kind="integer", minimum=1,
    )
    expert: bool = prop("Expert parallelism (--enable-expert-parallel).", kind="boolean",
                        default=False)
    nodes: int = prop("Number of nodes in the group; tensor*data must divide evenly over them.",
                      kind="integer", minimum=1, maximum=MAX_NODES, default=1)

    @property
    def ranks_per_node(self) -> int:
        """tensor * data / nodes when the user's values split evenly, else 0."""
        tensor, data, nodes = _int(self.tensor, 1), _int(self.data, 1), _int(self.nodes, 1)
        world = tensor * data
        return world // nodes if nodes > 0 and world % nodes == 0 else 0

    def default_data_local(self) -> int:
        """The DP ranks each node holds: whole TP groups per node, else one."""
        per_node, tensor = self.ranks_per_node, _int(self.tensor, 1)
        if per_node and tensor <= per_node and per_node % tensor == 0:
            return per_node // tensor
        return 1

    def pipeline_problem(self) -> str | None:
        """The one pipeline rule (the CRD's CEL rule says the same): absent or 1."""
        return None if self.pipeline in (None, 1) else PIPELINE_MESSAGE

    def layout(self) -> Layout:
        """The group layout of a valid spec (every node's view: node_rank 0)."""
        return Layout(tensor=self.tensor, data=self.data, nodes=self.nodes,
                      data_local=self.data_local, expert=bool(self.expert))


@dataclass(frozen=True)
class Placement(_Object):
    DESCRIPTION = (
        "Which nodes may hold the cache (the operator picks exactly parallelism.nodes of them)."
    )

    node_selector: dict[str, str] = prop("Labels a node must carry.", kind="labels",
                                         factory=dict)
    tolerations: list[dict[str, Any]] = prop(
        "core/v1 Tolerations of the agent pods (and of placement).",
        kind="array", items=("free", "A core/v1 Toleration."), factory=list,
    )
    affinity: dict[str, Any] | None = prop(
        "core/v1 Affinity of the agent pods; required node affinity also limits placement.",
        kind="free",
    )
    priority_class_name: str | None = prop("PriorityClass of the agent pods.", kind="string")


@dataclass(frozen=True)
class UpdateStrategy(_Object):
    DESCRIPTION = (
        "How a new model revision (spec.model.path or revision) reaches a running "
        "cache. InPlace (default, runtime native): the daemons write the new revision "
        "into their existing memory while engines pause, keeping every address; "
        "refused (and reported) when the tensor layout differs. Recreate: restart the "
        "group on the new revision (what runtime vllm always does)."
    )

    type: str = prop("InPlace or Recreate.", kind="string", enum=list(UPDATE_STRATEGIES),
                     default="InPlace")


@dataclass(frozen=True)
class Engine(_Object):
    DESCRIPTION = (
        "Defaults injected into opted-in engine pods (per-pod annotations override mode and "
        "fallback)."
    )

    mode: str = prop(
        "zero_copy maps the daemon's memory; copy clones it and lets the daemon release.",
        kind="string", enum=list(vocabulary.MODES), default="zero_copy",
    )
    fallback: bool = prop(
        "Load from disk when the daemon is unavailable or its fingerprint differs.",
        kind="boolean", default=True,
    )
    connect_timeout_seconds: float = prop(
        "Socket connect timeout in seconds.",
        kind="number", default=5, minimum=0, exclusiveMinimum=True,
    )
    state_timeout_seconds: float = prop(
        "Timeout of the weight transfer request in seconds.",
        kind="number", default=300, minimum=0, exclusiveMinimum=True,
    )


def _port(description: str, default: int | None) -> Any:
    return prop(description, kind="integer", default=default, minimum=1, maximum=65535)


@dataclass(frozen=True)
class Ports(_Object):
    DESCRIPTION = (
        "Ports of the agent pods (host network is not used; they must differ from each other)."
    )

    rendezvous: int = _port("Daemon group rendezvous port (--weight-cache-master-port).",
                            constants.DEFAULT_PORTS["rendezvous"])
    draft_rendezvous: int | None = _port(
        "Draft model group rendezvous port (default: rendezvous + 1).", None
    )
    health: int = _port("HTTP liveness/readiness port of the agent.",
                        constants.DEFAULT_PORTS["health"])
    metrics: int = _port("Prometheus /metrics port of the agent.",
                         constants.DEFAULT_PORTS["metrics"])
    grpc: int = _port("gRPC status/control port of the agent (also the gRPC health service).",
                      constants.DEFAULT_PORTS["grpc"])
    seed: int = _port(
        "First port of the warmup seed listeners (vLLM --seed-listen-port; runtime vllm with "
        "warmup.seed on): each daemon listens on seed + its global rank (draft daemons after "
        "the target block), on the pod IP.",
        constants.DEFAULT_PORTS["seed"])

    NAMES: ClassVar[tuple[str, ...]] = ("rendezvous", "draftRendezvous", "health", "metrics",
                                         "grpc", "seed")

    def by_name(self) -> dict[str, int]:
        """The ports keyed by their spec names (what the agent's runtimes look up)."""
        return {name: self.to_dict().get(name) for name in self.NAMES}  # type: ignore[misc]


@dataclass(frozen=True)
class RunAs(_Object):
    DESCRIPTION = (
        "UID/GID the daemons run as; engines must run as the same UID (the daemon checks the "
        "peer's credentials)."
    )

    uid: int = prop("User ID.", kind="integer", minimum=0, default=1000)
    gid: int = prop("Group ID.", kind="integer", minimum=0, default=1000)


@dataclass(frozen=True)
class Seed(_Object):
    DESCRIPTION = (
        "Seeding new replicas (runtime vllm, world size > 1): the daemons of a cache serve "
        "their FlashInfer autotune tables to the daemons of caches that name it in `from`, "
        "over vLLM's token-authenticated seed channel, so those start without tuning again "
        "(docs/warmup.md, \"Seeding new replicas\")."
    )

    enabled: bool = prop(
        "Serve this cache's tables to caches naming it in `from` (or, with `from`, adopt "
        "them). false passes no seed flags at all.",
        kind="boolean", default=True,
    )
    from_: str | None = prop(
        "Name of another WeightCache in the same namespace (never another namespace) with the "
        "same runtime, image, model, engine arguments and layout: each node adopts the "
        "tables of the source's node of the same node rank while the source is Ready. A "
        "source that is not Ready or differs only means no seeding (condition Seeding).",
        kind="string", minLength=1, maxLength=63, pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$",
    )


@dataclass(frozen=True)
class Warmup(_Object):
    DESCRIPTION = (
        "The per-node directory of the warmup and compile caches (FlashInfer autotune "
        "tables, torch.compile / Inductor / Triton kernels, vLLM's startup plan) shared by "
        "this cache's daemons and its engines, so an engine starts with what the daemon "
        "tuned and with its own earlier compile artifacts (docs/warmup.md)."
    )

    enabled: bool = prop(
        "Share the directory with the daemons and mount it into opted-in engine pods.",
        kind="boolean", default=True,
    )
    cache_dir: str | None = prop(
        "Absolute host directory, private to runAs.uid (0700); each model identity gets "
        "its own subdirectory. Default: /var/cache/weightcache/<namespace>/<name>.",
        kind="string", pattern="^/",
    )
    startup_plan: bool = prop(
        "Set VLLM_ENABLE_STARTUP_PLAN=1 in vLLM engines: a restart on the same node skips "
        "memory profiling when vLLM's fingerprint matches.",
        kind="boolean", default=True,
    )
    seed: Seed = child(Seed)


@dataclass(frozen=True)
class WeightCacheSpec(_Object):
    DESCRIPTION = "The desired cache: one model, one layout, one group of nodes."
    REQUIRED = ("runtime", "model")
    VALIDATIONS = (
        {"rule": "self.runtime != 'vllm' || has(self.image)",
         "message": "runtime vllm needs spec.image: the engines' vLLM image"},
        {"rule": "self.runtime == 'native' || !has(self.device)",
         "message": "spec.device applies to runtime native only"},
        {"rule": "self.runtime == 'native' || !has(self.shardRules)",
         "message": "spec.shardRules applies to runtime native only"},
    )
    # Native only; the default depends on the runtime, so the schema states none.
    DEFAULT_DEVICE: ClassVar[str] = "cuda"

    runtime: str | None = prop(
        "vllm runs the official `vllm preload` from the engines' image; native runs this "
        "project's daemon (torch + safetensors) and serves any PyTorch consumer.",
        kind="string", enum=list(vocabulary.RUNTIMES),
    )
    image: str | None = prop(
        "For vllm: the engines' vLLM image, pinned by tag or digest (the fingerprint "
        "includes the vLLM version). For native: an optional agent image override.",
        kind="string",
    )
    device: str | None = prop("Native runtime only: cuda (default) or cpu (no GPU needed).",
                              kind="string", enum=list(vocabulary.DEVICES))
    model: Model = child(Model)
    engine_args: EngineArgs = child(EngineArgs)
    shard_rules: list[str] | None = prop(
        "Native runtime only: tensor-parallel shard rules REGEX=DIM "
        "(default: the built-in Llama preset).",
        kind="array", items=("string", SHARD_RULE_PATTERN),
    )
    parallelism: Parallelism = child(Parallelism)
    gpus_per_node: int | None = prop(
        "GPUs each chosen node must have and the cache uses. Default: tensor*data/nodes. "
        "A dense single-node model with fewer ranks than this fills the node with "
        "independent replicas.",
        kind="integer", minimum=1, maximum=MAX_GPUS_PER_NODE,
    )
    placement: Placement = child(Placement)
    update_strategy: UpdateStrategy = child(UpdateStrategy)
    socket_dir: str | None = prop(
        "Absolute host directory of the daemons' Unix sockets (mounted into engine "
        "pods). Default: /var/run/weightcache/<namespace>/<name>.",
        kind="string", pattern="^/",
    )
    warmup: Warmup = child(Warmup)
    engine: Engine = child(Engine)
    ports: Ports = child(Ports)
    resources: dict[str, Any] = prop(
        "core/v1 ResourceRequirements of the agent container. No GPU requests are "
        "added: the agent sees every GPU of its node.",
        kind="free", factory=dict,
    )
    run_as: RunAs = child(RunAs)
    # Nested objects written as something else, by camelCase key (kept for validation).
    malformed: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, raw: Mapping[str, Any] | None, namespace: str, name: str
                  ) -> WeightCacheSpec:
        """Parse a spec once, every default filled (docs/interfaces.md, "WeightCache spec")."""
        values, malformed = cls.raw_values(raw or {})
        if values.get("runtime") == "native":
            values.setdefault("device", cls.DEFAULT_DEVICE)
        model = values.get("model", Model())
        if model.volume is None and isinstance(model.mount_path, str) and "model" not in \
                malformed:
            model = dataclasses.replace(model, volume=Model.default_volume(model.mount_path))
        values["model"] = model
        par = values.get("parallelism", Parallelism())
        if par.data_local is None:
            values["parallelism"] = dataclasses.replace(par, data_local=par.default_data_local())
        if "gpus_per_node" not in values and "parallelism" not in malformed \
                and par.ranks_per_node:
            values["gpus_per_node"] = par.ranks_per_node
        values.setdefault("socket_dir", constants.default_socket_dir(namespace, name))
        warmup = values.get("warmup", Warmup())
        if warmup.cache_dir is None:
            values["warmup"] = dataclasses.replace(
                warmup, cache_dir=constants.default_warmup_dir(namespace, name))
        ports = values.get("ports", Ports())
        if ports.draft_rendezvous is None:
            # vLLM's own default: the draft group listens one above the main rendezvous.
            rendezvous = _int(ports.rendezvous, constants.DEFAULT_PORTS["rendezvous"])
            values["ports"] = dataclasses.replace(ports, draft_rendezvous=rendezvous + 1)
        return cls(**values, malformed=malformed)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> WeightCacheSpec:
        """The spec of a WeightCache object, parsed with its own namespace and name."""
        meta = obj.get("metadata") or {}
        return cls.from_spec(obj.get("spec") or {}, meta.get("namespace") or "default",
                             meta.get("name") or "")

    # -- what other fields imply, stated once ---------------------------------------------

    @property
    def device_kind(self) -> str:
        """The device the daemons run on: runtime vllm is CUDA only."""
        if self.runtime == "vllm":
            return "cuda"
        return str(self.device or self.DEFAULT_DEVICE)

    @property
    def needs_gpus(self) -> bool:
        return self.device_kind != "cpu"

    @property
    def update_type(self) -> str:
        """InPlace or Recreate for a valid spec; runtime vllm always recreates (its daemon has
        no update command: vllm/model_executor/model_loader/weight_cache/daemon.py)."""
        wanted = self.update_strategy.type or "InPlace"
        return wanted if self.runtime == "native" else "Recreate"

    def layout(self) -> Layout:
        """The group's parallel layout (call only for a valid spec)."""
        return self.parallelism.layout()

    @property
    def gpus(self) -> int:
        """GPUs each chosen node must have (call only for a valid spec)."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return self.layout().ranks_per_node

    def launched_layout(self) -> Layout:
        """The layout the daemons are launched with: replicas that fill a node counted as
        data-parallel ranks (call only for a valid spec)."""
        return self.layout().filled(self.gpus)

    def with_layout(self, layout: Layout, gpus_per_node: int) -> WeightCacheSpec:
        """This spec stating `layout` (what a plan carries: the launched layout)."""
        parallelism = Parallelism(tensor=layout.tensor, data=layout.data, nodes=layout.nodes,
                                  data_local=layout.data_local, expert=layout.expert)
        return dataclasses.replace(self, parallelism=parallelism, gpus_per_node=gpus_per_node)

    def with_model(self, path: str, revision: str | None) -> WeightCacheSpec:
        """This spec serving another model revision."""
        model = dataclasses.replace(self.model, path=path, revision=revision or None)
        return dataclasses.replace(self, model=model)


def with_defaults(spec: Mapping[str, Any] | None, namespace: str, name: str) -> dict[str, Any]:
    """The spec document with every default filled, user values kept (a deep copy)."""
    return WeightCacheSpec.from_spec(spec, namespace, name).to_dict()
