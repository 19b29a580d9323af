"""Semantic validation of a WeightCache spec (its defaults live in `weightcache.api.v1alpha1`).

The CRD's OpenAPI schema catches types, enums and ranges; the rules here are the ones it
cannot express (layout arithmetic, port collisions, image reference form, volume types).
They read the typed spec, which keeps the values the user wrote even when invalid, so each
problem names the user's own field. The same functions serve the operator (which turns
problems into an Invalid condition) and the validating admission webhook (which turns them
into a denial), so a spec the webhook admits is one the operator can place.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache import constants
from weightcache.api.v1alpha1 import (
    UPDATE_STRATEGIES,
    Engine,
    Parallelism,
    WeightCacheSpec,
)
from weightcache.constants import DEFAULT_PLAN_PATH
from weightcache.contracts import seed as seed_contract
from weightcache.contracts.vocabulary import DEVICES, MODES, RUNTIMES
from weightcache.operator import imageref

# Every object a cache owns is named `<name><suffix>`, and each of those names must itself be
# valid: the rendezvous Service's name is a DNS-1035 label (at most 63 characters, starting
# with a letter: pkg/apis/core/validation ValidateServiceName = NameIsDNS1035Label on
# Kubernetes <= 1.35), so the cache's own name must leave room for the longest suffix.
DERIVED_NAMES = (
    constants.agent_daemonset_name,
    constants.rendezvous_service_name,
    constants.placement_configmap_name,
    constants.seed_secret_name,
)
MAX_NAME_LENGTH = 63 - max(len(derive("")) for derive in DERIVED_NAMES)
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RE = re.compile(NAME_PATTERN)
# Volume sources that can hold a checkpoint and that a DaemonSet pod on any chosen node
# can mount. Sources that are per-pod scratch or projections of API objects cannot.
MOUNTABLE_VOLUMES = frozenset(
    {
        "hostPath",
        "persistentVolumeClaim",
        "nfs",
        "csi",
        "ephemeral",
        "image",
        "iscsi",
        "cephfs",
        "rbd",
        "glusterfs",
        "fc",
        "azureFile",
        "azureDisk",
        "awsElasticBlockStore",
        "gcePersistentDisk",
        "cinder",
        "flexVolume",
        "portworxVolume",
        "quobyte",
        "scaleIO",
        "storageos",
        "vsphereVolume",
        "photonPersistentDisk",
        "flocker",
    }
)
UNMOUNTABLE_VOLUMES = {
    "emptyDir": "an emptyDir starts empty on every pod",
    "configMap": "a ConfigMap is limited to 1 MiB",
    "secret": "a Secret is limited to 1 MiB",
    "downwardAPI": "the downward API carries pod metadata only",
    "projected": "a projected volume carries API objects only",
    "gitRepo": "gitRepo is deprecated and disabled on most clusters",
}
# Volume sources whose access mode typically allows one node only: fine for a one-node
# cache, a silent half-built group for a multi-node one.
SINGLE_NODE_VOLUMES = frozenset(
    {"awsElasticBlockStore", "gcePersistentDisk", "azureDisk", "cinder", "rbd", "iscsi", "fc"}
)

SHARD_RULE_RE = re.compile(r"^(?P<pattern>.+)=(?P<dim>-?[0-9]+)$")
RESERVED_PATHS = ("/etc/weightcache", "/proc", "/sys", "/dev")


@dataclass(frozen=True)
class Problem:
    """One reason a spec cannot be placed: the JSON path of the field and how to fix it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def name_problems(name: str) -> list[Problem]:
    """Problems of a cache's name: every derived object name must be a valid Service name."""
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            Problem(
                "metadata.name",
                f"is {len(name)} characters; at most {MAX_NAME_LENGTH} are allowed so that "
                f"{constants.rendezvous_service_name(name)!r} fits the 63-character limit of a "
                "Service name",
            )
        )
    if not NAME_RE.match(name):
        problems.append(
            Problem(
                "metadata.name",
                f"{name!r} must start with a lowercase letter and hold only lowercase letters, "
                "digits and '-' (ending with a letter or digit): it names a Service, and "
                "Service names are DNS-1035 labels",
            )
        )
    return problems


def validate(spec: WeightCacheSpec | Mapping[str, Any], name: str | None = None
             ) -> list[Problem]:
    """Semantic problems of a spec; empty when it can be placed.

    A mapping is parsed first (`WeightCacheSpec.from_spec`, defaults filled). `name`, the
    cache's own name, lets a seed source naming the cache itself be refused."""
    full = (
        spec if isinstance(spec, WeightCacheSpec)
        else WeightCacheSpec.from_spec(spec, "default", "cache")
    )
    problems: list[Problem] = []
    problems += _check_runtime(full)
    problems += _check_model(full)
    problems += _check_layout(full)
    problems += _check_ports(full)
    problems += _check_socket_dir(full.socket_dir)
    problems += _check_warmup(full)
    if not problems:
        problems += _check_seed(full, name)
    problems += _check_engine(full)
    problems += _check_update_strategy(full)
    return problems


def _check_update_strategy(spec: WeightCacheSpec) -> list[Problem]:
    problems = []
    kind = spec.malformed.get("updateStrategy", spec.update_strategy.type)
    if kind not in UPDATE_STRATEGIES:
        problems.append(Problem("spec.updateStrategy.type",
                                f"must be one of {', '.join(UPDATE_STRATEGIES)}, not {kind!r}"))
    revision = None if "model" in spec.malformed else spec.model.revision
    if revision is not None and (not isinstance(revision, str) or len(revision) > 256):
        problems.append(Problem("spec.model.revision", "must be a string of at most 256 chars"))
    return problems


def _check_runtime(spec: WeightCacheSpec) -> list[Problem]:
    problems = []
    runtime = spec.runtime
    if runtime not in RUNTIMES:
        return [Problem("spec.runtime", f"must be one of {', '.join(RUNTIMES)}, not {runtime!r}")]
    image = spec.image
    if runtime == "vllm":
        if not image:
            problems.append(
                Problem(
                    "spec.image",
                    "runtime vllm needs the engines' vLLM image (e.g. vllm/vllm-openai:v0.33.0): "
                    "the weight fingerprint includes the vLLM version, so daemons and engines "
                    "must run the same image",
                )
            )
        if spec.device not in (None, "cuda"):
            problems.append(
                Problem("spec.device", "runtime vllm runs on CUDA only; remove spec.device")
            )
        if spec.shard_rules:
            problems.append(
                Problem(
                    "spec.shardRules",
                    "shard rules apply to runtime native only (vLLM shards by its model "
                    "definition); remove spec.shardRules",
                )
            )
    if image:
        problems += _check_image(str(image), runtime)
    if runtime == "native" and spec.device not in DEVICES:
        problems.append(
            Problem("spec.device", f"must be one of {', '.join(DEVICES)}, not {spec.device!r}")
        )
    par = spec.parallelism
    if runtime == "native" and par.expert and int(par.data or 1) > 1:
        problems.append(
            Problem(
                "spec.parallelism.expert",
                "runtime native shards by tensor-parallel rules only and cannot lay out experts "
                "across data-parallel ranks; use runtime vllm for expert parallelism with "
                "data > 1, or set expert: false",
            )
        )
    for i, rule in enumerate(spec.shard_rules or []):
        problems += _check_shard_rule(i, rule)
    return problems


def _check_image(image: str, runtime: str) -> list[Problem]:
    parts = imageref.parse(image)
    if parts is None:
        return [
            Problem(
                "spec.image",
                f"{image!r} is not an image reference; write REGISTRY/REPOSITORY:TAG "
                "(lower-case repository) or REPOSITORY@sha256:DIGEST",
            )
        ]
    # The tag must pin a version (the vLLM fingerprint includes it): no tag or `latest`
    # is rejected for runtime vllm.
    if runtime == "vllm" and not parts.pins_version:
        return [
            Problem(
                "spec.image",
                f"{image!r} does not pin a version; use the exact tag or digest the engines "
                "run (e.g. vllm/vllm-openai:v0.33.0): a moving tag lets daemons and engines "
                "drift apart and every restart silently falls back to disk",
            )
        ]
    return []


def _check_shard_rule(index: int, rule: Any) -> list[Problem]:
    field = f"spec.shardRules[{index}]"
    match = SHARD_RULE_RE.match(rule) if isinstance(rule, str) else None
    if not match:
        return [Problem(field, f"{rule!r} must have the form REGEX=DIM, e.g. '.*q_proj.weight=0'")]
    try:
        re.compile(match["pattern"])
    except re.error as exc:
        return [Problem(field, f"the regular expression {match['pattern']!r} is invalid: {exc}")]
    return []


def _check_model(spec: WeightCacheSpec) -> list[Problem]:
    if "model" in spec.malformed:
        return [Problem("spec.model", "set spec.model.path to the checkpoint directory")]
    model = spec.model
    problems = []
    path, mount = model.path, model.mount_path
    if not isinstance(mount, str) or not posixpath.isabs(mount):
        problems.append(
            Problem("spec.model.mountPath", f"must be an absolute path like /models, not {mount!r}")
        )
    elif any(_under(mount, reserved) for reserved in RESERVED_PATHS):
        problems.append(
            Problem(
                "spec.model.mountPath",
                f"{mount} collides with a path the agent reserves; mount the model elsewhere, "
                "e.g. /models",
            )
        )
    if not isinstance(path, str) or not path:
        problems.append(Problem("spec.model.path", "set the checkpoint directory: /models/llama"))
    elif isinstance(mount, str) and posixpath.isabs(mount):
        full = path if posixpath.isabs(path) else posixpath.join(mount, path)
        if not _under(posixpath.normpath(full), posixpath.normpath(mount)):
            problems.append(
                Problem(
                    "spec.model.path",
                    f"{path} lies outside the model volume mounted at {mount}; give a path "
                    f"under {mount} or change spec.model.mountPath",
                )
            )
    problems += _check_volume(model.volume, spec)
    if isinstance(mount, str) and isinstance(spec.socket_dir, str) \
            and _overlap(spec.socket_dir, mount):
        problems.append(
            Problem(
                "spec.model.mountPath",
                f"{mount} overlaps the socket directory {spec.socket_dir}; keep them apart",
            )
        )
    if spec.runtime == "native" and isinstance(mount, str) and posixpath.isabs(mount) \
            and _overlap(mount, constants.DAEMON_STATE_ROOT):
        problems.append(
            Problem(
                "spec.model.mountPath",
                f"{mount} overlaps {constants.DAEMON_STATE_ROOT}, where the daemons keep their "
                "state; mount the model elsewhere, e.g. /models",
            )
        )
    return problems


def _check_volume(volume: Any, spec: WeightCacheSpec) -> list[Problem]:
    field = "spec.model.volume"
    if not isinstance(volume, dict):
        return [Problem(field, "must be one core/v1 volume source: {hostPath: {path: /models}}")]
    sources = [key for key in volume if key != "name"]
    if len(sources) != 1:
        return [
            Problem(
                field,
                f"give exactly one volume source (found {sorted(sources) or 'none'}), "
                "e.g. hostPath or persistentVolumeClaim",
            )
        ]
    kind = sources[0]
    body = volume[kind]
    if kind in UNMOUNTABLE_VOLUMES:
        return [
            Problem(
                f"{field}.{kind}",
                f"the agent cannot load a model from it: {UNMOUNTABLE_VOLUMES[kind]}; use "
                "hostPath, persistentVolumeClaim, nfs, csi or image",
            )
        ]
    if kind not in MOUNTABLE_VOLUMES:
        return [Problem(f"{field}.{kind}", f"unknown volume source {kind!r}; use a core/v1 one")]
    if not isinstance(body, dict):
        return [Problem(f"{field}.{kind}", "must be an object")]
    problems = []
    if kind == "hostPath":
        host = body.get("path")
        if not isinstance(host, str) or not posixpath.isabs(host):
            problems.append(
                Problem(f"{field}.hostPath.path", f"must be an absolute host path, not {host!r}")
            )
        if body.get("type") in ("File", "FileOrCreate", "Socket", "CharDevice", "BlockDevice"):
            problems.append(
                Problem(
                    f"{field}.hostPath.type",
                    f"a checkpoint is a directory; use Directory (not {body['type']})",
                )
            )
    if kind == "persistentVolumeClaim" and not body.get("claimName"):
        problems.append(Problem(f"{field}.persistentVolumeClaim.claimName", "name the claim"))
    if kind == "nfs" and not (body.get("server") and body.get("path")):
        problems.append(Problem(f"{field}.nfs", "set both server and path"))
    if kind == "image" and not body.get("reference"):
        problems.append(Problem(f"{field}.image.reference", "name the OCI image holding the model"))
    nodes = 1 if "parallelism" in spec.malformed else _int(spec.parallelism.nodes, 1)
    if kind in SINGLE_NODE_VOLUMES and nodes > 1:
        problems.append(
            Problem(
                f"{field}.{kind}",
                f"a {kind} volume attaches to one node at a time but the group spans {nodes} "
                "nodes; use a ReadOnlyMany persistentVolumeClaim, nfs, csi or hostPath",
            )
        )
    return problems


def _check_layout(spec: WeightCacheSpec) -> list[Problem]:
    if "parallelism" in spec.malformed:
        return [Problem("spec.parallelism", "must be an object")]
    par: Parallelism = spec.parallelism
    problems = []
    values = {}
    for key, value in (("tensor", par.tensor), ("data", par.data), ("nodes", par.nodes),
                       ("dataLocal", par.data_local)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(
                Problem(f"spec.parallelism.{key}", f"must be an integer >= 1: {value!r}")
            )
        values[key] = value
    pipeline = []
    if par.pipeline_problem():
        pipeline.append(
            Problem(
                "spec.parallelism.pipeline",
                "pipeline parallelism is not supported by the weight cache daemon; remove it "
                "(or set 1) and use tensor, data or expert parallelism",
            )
        )
    gpus = spec.gpus_per_node
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        problems.append(Problem("spec.gpusPerNode", f"must be an integer >= 1, not {gpus!r}"))
        gpus = None
    if problems:
        return problems + pipeline
    tensor, data, nodes = values["tensor"], values["data"], values["nodes"]
    world = tensor * data
    if world % nodes:
        return [
            *pipeline,
            Problem(
                "spec.parallelism.nodes",
                f"tensor x data = {tensor} x {data} = {world} ranks cannot be split evenly over "
                f"{nodes} nodes; choose nodes that divide {world} "
                f"(e.g. {', '.join(str(n) for n in _divisors(world)[:6])})",
            ),
        ]
    per_node = world // nodes
    if tensor > per_node and tensor % per_node:
        problems.append(
            Problem(
                "spec.parallelism.tensor",
                f"a tensor-parallel group of {tensor} must span whole nodes of {per_node} ranks; "
                f"make tensor a multiple of {per_node} or change nodes",
            )
        )
    if tensor <= per_node and per_node % tensor:
        problems.append(
            Problem(
                "spec.parallelism.tensor",
                f"{per_node} ranks per node do not hold a whole number of tensor-parallel groups "
                f"of {tensor}; change data or nodes so tensor divides tensor x data / nodes",
            )
        )
    data_local = values["dataLocal"]
    expected_local = per_node // tensor if tensor <= per_node else 1
    if not problems and data_local != expected_local:
        problems.append(
            Problem(
                "spec.parallelism.dataLocal",
                f"with tensor {tensor}, data {data} over {nodes} nodes each node holds "
                f"{expected_local} data-parallel rank(s); set dataLocal to {expected_local} "
                "or remove it",
            )
        )
    if gpus is not None:
        if gpus < per_node:
            problems.append(
                Problem(
                    "spec.gpusPerNode",
                    f"{gpus} GPUs per node cannot hold the {per_node} ranks each node serves "
                    f"(tensor x data / nodes = {tensor} x {data} / {nodes}); set gpusPerNode to "
                    f"{per_node} or more nodes",
                )
            )
        elif gpus > per_node:
            if par.expert:
                problems.append(
                    Problem(
                        "spec.gpusPerNode",
                        f"an expert-parallel layout cannot be replicated within a node; set "
                        f"gpusPerNode to {per_node} or raise data to {gpus * nodes // tensor}",
                    )
                )
            elif nodes > 1:
                problems.append(
                    Problem(
                        "spec.gpusPerNode",
                        f"a multi-node group uses exactly {per_node} GPUs per node; set "
                        f"gpusPerNode to {per_node}, or raise data so tensor x data / nodes "
                        f"= {gpus}",
                    )
                )
            elif gpus % per_node:
                problems.append(
                    Problem(
                        "spec.gpusPerNode",
                        f"{gpus} GPUs do not hold a whole number of {per_node}-rank replicas; "
                        f"use a multiple of {per_node}",
                    )
                )
    return problems + pipeline


def _check_ports(spec: WeightCacheSpec) -> list[Problem]:
    if "ports" in spec.malformed:
        return [Problem("spec.ports", "must be an object")]
    problems = []
    seen: dict[int, str] = {}
    for key, port in spec.ports.by_name().items():
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            problems.append(Problem(f"spec.ports.{key}", f"must be a port 1-65535, not {port!r}"))
            continue
        if port in seen:
            problems.append(
                Problem(
                    f"spec.ports.{key}",
                    f"port {port} is already used by spec.ports.{seen[port]}; give each port its "
                    "own number",
                )
            )
        else:
            seen[port] = key
    return problems


def _check_socket_dir(socket_dir: Any) -> list[Problem]:
    return _check_host_dir(socket_dir, "spec.socketDir", "/var/run/weightcache/NS/NAME")


def _check_host_dir(value: Any, field: str, example: str) -> list[Problem]:
    """A private host directory of the cache: absolute, normal form, not a system path."""
    if not isinstance(value, str) or not posixpath.isabs(value):
        return [Problem(field, f"must be an absolute host path like {example}: {value!r}")]
    norm = posixpath.normpath(value)
    if norm != value.rstrip("/") or ".." in value.split("/"):
        return [Problem(field, f"write it in normal form ({norm}), without '..' or '//'")]
    if norm == "/" or any(_under(norm, reserved) for reserved in (*RESERVED_PATHS, "/etc")):
        return [Problem(field, f"{value} is a system path; use {example}")]
    if _under(norm, posixpath.dirname(DEFAULT_PLAN_PATH)):
        return [Problem(field, "collides with the agent's plan directory")]
    if _overlap(norm, constants.DAEMON_STATE_ROOT):
        # Each cache's daemons keep their state there (operator/resources.daemon_state_dir),
        # mounted into no engine: a directory engines mount must not reach it.
        return [Problem(field, f"{value} overlaps {constants.DAEMON_STATE_ROOT}, where the "
                               f"daemons keep their state; use {example}")]
    return []


def _check_warmup(spec: WeightCacheSpec) -> list[Problem]:
    """The warmup directory holds code engines load: it must be the cache's alone, apart
    from the sockets and the model (docs/warmup.md, "Trust")."""
    if "warmup" in spec.malformed:
        return [Problem("spec.warmup", "must be an object: {cacheDir: /var/cache/...}")]
    warmup = spec.warmup
    problems = [
        Problem(f"spec.warmup.{key}", f"must be true or false: {value!r}")
        for key, value in (("enabled", warmup.enabled), ("startupPlan", warmup.startup_plan))
        if not isinstance(value, bool)
    ]
    field = "spec.warmup.cacheDir"
    found = _check_host_dir(warmup.cache_dir, field, "/var/cache/weightcache/NS/NAME")
    if found:
        return problems + found
    norm = posixpath.normpath(str(warmup.cache_dir))
    others = [("spec.socketDir", spec.socket_dir)]
    if "model" not in spec.malformed:
        others.append(("spec.model.mountPath", spec.model.mount_path))
    for name, other in others:
        if isinstance(other, str) and posixpath.isabs(other) and _overlap(norm, other):
            problems.append(Problem(field, f"{warmup.cache_dir} overlaps {name} {other}; "
                                           "keep them apart"))
    return problems


def _check_seed(spec: WeightCacheSpec, name: str | None) -> list[Problem]:
    """warmup.seed (docs/warmup.md, "Seeding new replicas"): a source in the same namespace,
    and a listener port block that fits and collides with no other port. Called on a spec
    whose layout, ports and warmup are valid."""
    seed = spec.warmup.seed
    field = "spec.warmup.seed"
    if not isinstance(seed.enabled, bool):
        return [Problem(f"{field}.enabled", f"must be true or false: {seed.enabled!r}")]
    problems = []
    source = seed.from_
    if source is not None:
        if not isinstance(source, str) or not source:
            return [Problem(f"{field}.from", f"must be the name of a WeightCache: {source!r}")]
        if "/" in source:
            problems.append(Problem(
                f"{field}.from", f"{source!r} names another namespace; seeding never crosses "
                "namespaces (the token and the NetworkPolicy are per namespace): name a "
                "WeightCache of this namespace"))
        elif not NAME_RE.match(source) or len(source) > MAX_NAME_LENGTH:
            problems.append(Problem(f"{field}.from",
                                    f"{source!r} is not a valid WeightCache name"))
        elif source == name:
            problems.append(Problem(f"{field}.from", "a cache cannot seed from itself"))
        if spec.runtime != "vllm":
            problems.append(Problem(f"{field}.from", "seeding applies to runtime vllm only"))
        elif seed.enabled is not True:
            problems.append(Problem(f"{field}.from", "is set but spec.warmup.seed.enabled "
                                                      "is false; remove one"))
        elif spec.warmup.enabled is not True:
            problems.append(Problem(f"{field}.from", "needs spec.warmup.enabled: true (the "
                                                      "adopted tables live in its directory)"))
    if seed_contract.not_applicable(spec) is None:
        first = spec.ports.seed
        last = first + seed_contract.port_block(spec) - 1
        if last > 65535:
            problems.append(Problem("spec.ports.seed", f"the seed ports {first}-{last} of "
                                                       "this layout exceed 65535"))
        for key, port in spec.ports.by_name().items():
            if key != "seed" and first <= port <= last:
                problems.append(Problem(
                    "spec.ports.seed", f"the seed ports {first}-{last} (one per daemon rank) "
                    f"include spec.ports.{key} {port}; move one of them"))
    return problems


def _check_engine(spec: WeightCacheSpec) -> list[Problem]:
    if "engine" in spec.malformed:
        return [Problem("spec.engine", "must be an object")]
    engine: Engine = spec.engine
    problems = []
    if engine.mode not in MODES:
        problems.append(
            Problem("spec.engine.mode", f"must be one of {', '.join(MODES)}: {engine.mode!r}")
        )
    for key, value in (("connectTimeoutSeconds", engine.connect_timeout_seconds),
                       ("stateTimeoutSeconds", engine.state_timeout_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(Problem(f"spec.engine.{key}", f"must be a positive number: {value!r}"))
    return problems


def _int(value: Any, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return value


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _overlap(a: str, b: str) -> bool:
    """Whether one path lies within the other (normalized first)."""
    a, b = posixpath.normpath(a), posixpath.normpath(b)
    return _under(a, b) or _under(b, a)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
