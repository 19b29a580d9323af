"""Builders of the objects a WeightCache owns: plan ConfigMap, rendezvous Service, agent DaemonSet.

Pure functions from (cache, defaulted spec, placement) to manifests, so their shape is
tested without an API server and the reconciler only compares and applies.

Node ranks on pods: a DaemonSet has one pod template, so every agent pod gets the same
labels. The operator therefore labels each agent pod with `weightcache.io/node-rank` after
the pod appears (it knows the pod's node from `spec.nodeName` and the rank from the plan);
the rendezvous Service selects the pod labelled `0`. The agent itself never needs the
label: it reads its rank from the mounted plan by node name, so a label that lags behind
only delays the Service's endpoint, never the daemons' layout.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from weightcache import __version__, constants
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import seed as seed_contract
from weightcache.contracts.plan import SEED_KEY, Plan, SeedSource

ANN_PLAN_HASH = f"{constants.GROUP}/plan-hash"
WARMUP_VOLUME = "warmup"
STATE_VOLUME = "daemon-state"
SEED_VOLUME = "seed-token"
AGENT_CONTAINER = "agent"
PLAN_MOUNT_DIR = "/etc/weightcache"
AGENT_LIB_DIR = "/opt/weightcache"
DEFAULT_AGENT_IMAGE = f"weightcache/agent:{__version__}"
GPU_RESOURCE_PREFIXES = ("nvidia.com/", "amd.com/")
# Agent containers without requests would be BestEffort: the first pods evicted under node
# pressure, although they hold every GPU's weights. Requests only, never a memory limit: the
# daemons' host memory grows with the checkpoint (native CPU caches hold it all).
DEFAULT_AGENT_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
# Copies the agent's Python packages out of the agent image into a shared volume, so that
# runtime `vllm` runs the agent inside the engines' own vLLM image (the agent image's Python
# minor version must match the vLLM image's, since grpc has a compiled extension).
COPY_AGENT_SCRIPT = (
    "import importlib, os, shutil, sys\n"
    "dst = sys.argv[1]\n"
    "for name in ('weightcache', 'msgpack', 'grpc', 'grpc_health', 'google.protobuf',\n"
    "             'google._upb', 'prometheus_client', 'yaml'):\n"
    "    try:\n"
    "        mod = importlib.import_module(name)\n"
    "    except ImportError:\n"
    "        continue\n"
    "    src = os.path.dirname(mod.__file__)\n"
    "    shutil.copytree(src, os.path.join(dst, *name.split('.')), dirs_exist_ok=True)\n"
)
# Starts the agent with the copied packages *before* the image's own on sys.path: the agent
# runs with the exact grpc/protobuf its generated code was built against (a vLLM image's
# older protobuf would refuse it), and never imports vllm. `vllm preload` (a child process)
# never sees the copies: they are put on sys.path in this process only, no PYTHONPATH is set.
AGENT_BOOT_VLLM = (
    f"import sys; sys.path.insert(0, {AGENT_LIB_DIR!r}); "
    "from weightcache.cli import main; sys.exit(main(['agent']))"
)


@dataclass(frozen=True)
class AgentOptions:
    """Operator-wide settings of agent pods (command-line options of `weightcache operator`)."""

    image: str = DEFAULT_AGENT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    runtime_class: str | None = None
    service_account: str | None = None
    priority_class: str | None = None
    requests: Mapping[str, str] = dc_field(default_factory=lambda: dict(DEFAULT_AGENT_REQUESTS))


def labels(name: str) -> dict[str, str]:
    """Labels of every owned object and of the agent pod template (never the node rank)."""
    return {
        constants.LABEL_APP: constants.AGENT_APP,
        constants.LABEL_INSTANCE: name,
        constants.LABEL_CACHE: name,
    }


def owner_reference(cache: Mapping[str, Any]) -> dict[str, Any]:
    meta = cache["metadata"]
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(cache: Mapping[str, Any], name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": cache["metadata"]["namespace"],
        "labels": labels(cache["metadata"]["name"]),
        "ownerReferences": [owner_reference(cache)],
    }


def master_addr(namespace: str, name: str) -> str:
    return f"{constants.rendezvous_service_name(name)}.{namespace}.svc"


def plan(
    cache: Mapping[str, Any],
    spec: WeightCacheSpec,
    nodes: Sequence[str],
    epoch: int,
    seed_from: SeedSource | None = None,
) -> Plan:
    """The placement plan (docs/interfaces.md): everything an agent needs, so agents need no
    API access.

    Replicas that fill a node are expressed the way vLLM places data parallelism: `data`
    counts them, so every GPU's rank follows the global layout `node_rank * local + i`.
    """
    meta = cache["metadata"]
    layout = spec.launched_layout()
    gpus = spec.gpus
    return Plan(
        cache=meta["name"],
        namespace=meta["namespace"],
        uid=meta.get("uid", ""),
        epoch=epoch,
        runtime=str(spec.runtime),
        master_addr=master_addr(meta["namespace"], meta["name"]),
        node_count=layout.nodes,
        gpus_per_node=gpus,
        nodes={node: rank for rank, node in enumerate(nodes)},
        layout=layout,
        spec=spec.with_layout(layout, gpus),
        seed_from=seed_from,
    )


def plan_hash(doc: Plan) -> str:
    """Hash of what the agent pods must be recreated for (the DaemonSet template carries it).

    The update strategy never restarts pods by itself, so nothing that depends on it is
    hashed: on runtime native (the one that can update in place) the model path and revision
    are left out whatever the strategy says. With InPlace they reach the daemons through the
    agents' Update RPC and the plan ConfigMap follows once the update succeeded; with
    Recreate the operator restarts the group under a new epoch (the template's other
    annotation). Runtime vllm always recreates: there the path and revision are hashed."""
    view = json.loads(doc.to_json())
    # Where a seed source's agents live matters only when a daemon starts: a moved source
    # pod rewrites the plan, never restarts this group.
    view.pop(SEED_KEY, None)
    document = view["spec"]
    document.pop("updateStrategy", None)
    if doc.spec.runtime == "native":
        for key in ("path", "revision"):
            document["model"].pop(key, None)
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def configmap(cache: Mapping[str, Any], doc: Plan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(cache, constants.placement_configmap_name(cache["metadata"]["name"])),
        "data": {constants.PLAN_KEY: doc.to_json()},
    }


def seed_secret(cache: Mapping[str, Any]) -> dict[str, Any]:
    """The seed token of a source cache: 32 random bytes (hex), owned by the cache (deleted
    with it), immutable (rotating it means deleting it; the next pass creates a new one).
    The operator only ever creates it: it never reads a Secret back (docs/warmup.md)."""
    token = secrets.token_hex(seed_contract.TOKEN_BYTES)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(cache, constants.seed_secret_name(cache["metadata"]["name"])),
        "type": "Opaque",
        "immutable": True,
        "data": {seed_contract.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def seed_token_source(spec: WeightCacheSpec, name: str) -> str | None:
    """The cache whose token Secret this cache's agents mount: its own as a seed source, its
    source's with `warmup.seed.from`, none when seeding does not apply."""
    if seed_contract.not_applicable(spec) is not None:
        return None
    return spec.warmup.seed.from_ or name


def service(cache: Mapping[str, Any], spec: WeightCacheSpec) -> dict[str, Any]:
    """Headless Service whose DNS name resolves to the node-rank-0 agent pod (the master)."""
    name = cache["metadata"]["name"]
    ports = spec.ports
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(cache, constants.rendezvous_service_name(name)),
        "spec": {
            "clusterIP": "None",
            # The daemons rendezvous while they load, long before any pod is Ready.
            "publishNotReadyAddresses": True,
            "selector": {**labels(name), constants.LABEL_NODE_RANK: "0"},
            "ports": [
                {"name": "rendezvous", "port": ports.rendezvous, "protocol": "TCP"},
                {"name": "draft", "port": ports.draft_rendezvous, "protocol": "TCP"},
            ],
        },
    }


def _pinned_affinity(user: Mapping[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any]:
    """The user's affinity with every required node term narrowed to exactly `nodes`.

    The API server takes ONE value per `matchFields` requirement with `In`/`NotIn`
    (validation.go, validateNodeFieldSelectorRequirement), so each node gets its own term:
    every user term is crossed with every node (terms are ORed, requirements ANDed), which
    keeps the user's requirements and pins to the union of the nodes.
    """
    affinity = json.loads(json.dumps(user or {}))
    node_aff = affinity.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    user_terms = required.get("nodeSelectorTerms") or [{}]
    terms = []
    for node in sorted(nodes):
        for user_term in user_terms:
            term = json.loads(json.dumps(user_term))
            fields = [f for f in term.get("matchFields") or [] if f.get("key") != "metadata.name"]
            pin = {"key": "metadata.name", "operator": "In", "values": [node]}
            term["matchFields"] = [*fields, pin]
            terms.append(term)
    required["nodeSelectorTerms"] = terms
    return affinity


def pinned_nodes(pod_spec: Mapping[str, Any]) -> list[str]:
    """The node names a pod spec built by `daemonset` is pinned to (one per matchFields term)."""
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    names: list[str] = []
    for term in required.get("nodeSelectorTerms") or []:
        for req in term.get("matchFields") or []:
            if req.get("key") == "metadata.name" and req.get("operator") == "In":
                names += [v for v in req.get("values") or [] if v not in names]
    return names


def _agent_resources(
    resources: Mapping[str, Any] | None, defaults: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The user's resources without GPU requests: the device plugin would hand them out once.

    `defaults` fill requests the user left out, unless a limit is set for that resource (the
    API server demands request <= limit, and a request defaults to its limit anyway).
    """
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        values = {
            key: value
            for key, value in ((resources or {}).get(kind) or {}).items()
            if not key.startswith(GPU_RESOURCE_PREFIXES)
        }
        if values:
            out[kind] = values
    limits = out.get("limits") or {}
    extra = {k: v for k, v in (defaults or {}).items() if k not in limits}
    if extra:
        out["requests"] = {**extra, **(out.get("requests") or {})}
    return out


def daemon_state_dir(cache: Mapping[str, Any], spec: WeightCacheSpec) -> str | None:
    """The host directory where the cache's daemons keep state across agent pods (their
    import set, weightcache.native.shared.importset); None for runtime vllm, whose daemon is
    vLLM's own and keeps none. One per cache, never mounted into engines."""
    if spec.runtime != "native":
        return None
    meta = cache["metadata"]
    return constants.daemon_state_dir(meta["namespace"], meta["name"])


def _env(name: str, spec: WeightCacheSpec, state_dir: str | None) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    env = [
        {"name": constants.ENV_CACHE_NAME, "value": name},
        {"name": constants.ENV_NAMESPACE, "valueFrom": field("metadata.namespace")},
        {"name": constants.ENV_NODE_NAME, "valueFrom": field("spec.nodeName")},
        {"name": constants.ENV_POD_IP, "valueFrom": field("status.podIP")},
        {"name": constants.ENV_POD_NAME, "valueFrom": field("metadata.name")},
        {"name": constants.ENV_PLAN, "value": f"{PLAN_MOUNT_DIR}/{constants.PLAN_KEY}"},
        {"name": "HOME", "value": "/tmp"},
    ]
    if state_dir is not None:
        # The daemons inherit it: their import set outlives the pod (/tmp does not).
        env.append({"name": constants.ENV_IMPORT_SET,
                    "value": f"{state_dir}/{constants.IMPORT_SET_NAME}"})
    if spec.needs_gpus:
        # No GPU requests: the agent sees every GPU of the node and pins one rank per GPU.
        env += [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
        ]
    return env


def daemonset(
    cache: Mapping[str, Any],
    spec: WeightCacheSpec,
    doc: Plan,
    nodes: Sequence[str],
    options: AgentOptions,
) -> dict[str, Any]:
    """The agent DaemonSet, pinned to exactly the placed nodes.

    Template annotations carry the group epoch and the plan hash: bumping either one
    restarts every agent pod together (maxUnavailable 100%), since a multi-node daemon
    group cannot re-form around survivors.
    """
    name = cache["metadata"]["name"]
    vllm = spec.runtime == "vllm"
    ports, run_as = spec.ports, spec.run_as
    socket_dir = spec.socket_dir
    model = spec.model
    placement = spec.placement
    image = spec.image if vllm or spec.image else options.image
    volumes: list[dict[str, Any]] = [
        {"name": "sockets", "hostPath": {"path": socket_dir, "type": "DirectoryOrCreate"}},
        {
            "name": "plan",
            "configMap": {
                "name": constants.placement_configmap_name(name),
                "items": [{"key": constants.PLAN_KEY, "path": constants.PLAN_KEY}],
            },
        },
        {"name": "model", **{k: v for k, v in (model.volume or {}).items() if k != "name"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "sockets", "mountPath": socket_dir},
        {"name": "plan", "mountPath": PLAN_MOUNT_DIR, "readOnly": True},
        {"name": "model", "mountPath": model.mount_path, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    restricted = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    private_dirs = [socket_dir]
    dir_mounts = [{"name": "sockets", "mountPath": socket_dir}]

    def private_host_dir(volume: str, host_dir: str) -> None:
        """Another host directory of the cache, at the same path, made the uid's (0700)."""
        volumes.append({"name": volume,
                        "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
        mounts.append({"name": volume, "mountPath": host_dir})
        dir_mounts.append({"name": volume, "mountPath": host_dir})
        private_dirs.append(host_dir)

    if spec.warmup.enabled:
        # The warmup caches (docs/warmup.md): on disk, shared with the engines of this cache.
        private_host_dir(WARMUP_VOLUME, str(spec.warmup.cache_dir))
    state_dir = daemon_state_dir(cache, spec)
    if state_dir is not None:
        # The daemons' own state (their import set): on disk, never shared with engines.
        private_host_dir(STATE_VOLUME, state_dir)
    token_of = seed_token_source(spec, name)
    if token_of is not None:
        # Optional: a target whose source has no token yet starts without seeding instead of
        # waiting. Secret files are root-owned; 0444 lets the daemons' uid read it inside this
        # container (its only processes are the agent and vLLM). Not fsGroup: the kubelet
        # would re-own every volume that supports it, a model PVC included.
        volumes.append({"name": SEED_VOLUME, "secret": {
            "secretName": constants.seed_secret_name(token_of), "optional": True,
            "defaultMode": 0o444,
            "items": [{"key": seed_contract.TOKEN_KEY, "path": seed_contract.TOKEN_KEY}]}})
        mounts.append({"name": SEED_VOLUME, "mountPath": seed_contract.TOKEN_DIR,
                       "readOnly": True})
    init_containers = [
        {
            # hostPath directories are created root-owned; the daemons (and engines) run as
            # runAs.uid and the daemons demand private 0700 directories (sockets, warmup
            # caches, their own state).
            "name": "socket-dir",
            "image": options.image,
            "imagePullPolicy": options.image_pull_policy,
            "command": [
                "sh",
                "-c",
                'for d in "$0" "$@"; do '
                f'chown {run_as.uid}:{run_as.gid} "$d" && chmod 0700 "$d" || exit 1; done',
                *private_dirs,
            ],
            "securityContext": {
                "runAsUser": 0,
                "runAsNonRoot": False,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            },
            "volumeMounts": dir_mounts,
        }
    ]
    if vllm:
        volumes.append({"name": "agent-lib", "emptyDir": {}})
        mounts.append({"name": "agent-lib", "mountPath": AGENT_LIB_DIR, "readOnly": True})
        init_containers.append(
            {
                "name": "agent-lib",
                "image": options.image,
                "imagePullPolicy": options.image_pull_policy,
                "command": ["python3", "-c", COPY_AGENT_SCRIPT, AGENT_LIB_DIR],
                "securityContext": restricted,
                "volumeMounts": [{"name": "agent-lib", "mountPath": AGENT_LIB_DIR}],
            }
        )
    container = {
        "name": AGENT_CONTAINER,
        "image": image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["python3", "-c", AGENT_BOOT_VLLM]
        if vllm
        else ["python3", "-m", "weightcache.cli", "agent"],
        "env": _env(name, spec, state_dir),
        "ports": [
            {"name": "grpc", "containerPort": ports.grpc, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ports.metrics, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": ports.rendezvous, "protocol": "TCP"},
            {"name": "draft", "containerPort": ports.draft_rendezvous, "protocol": "TCP"},
        ],
        # The agent's gRPC health service: "readiness" is SERVING once every local rank
        # answers on its socket, "liveness" while its supervisor runs. Loading a large
        # checkpoint takes minutes, so liveness never waits on the load.
        "readinessProbe": {
            "grpc": {"port": ports.grpc, "service": "readiness"},
            "periodSeconds": 5,
        },
        "livenessProbe": {
            "grpc": {"port": ports.grpc, "service": "liveness"},
            "initialDelaySeconds": 10,
            "periodSeconds": 20,
            "failureThreshold": 6,
        },
        "resources": _agent_resources(spec.resources, options.requests),
        "securityContext": restricted,
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        # Stock vLLM IPC needs the exporter in the host PID namespace and the host's /dev/shm;
        # the native runtime passes VMM/memfd descriptors over the socket and needs neither.
        "hostPID": vllm,
        "hostIPC": vllm,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsUser": run_as.uid,
            "runAsGroup": run_as.gid,
            "runAsNonRoot": run_as.uid != 0,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": init_containers,
        "containers": [container],
        "volumes": volumes,
        "affinity": _pinned_affinity(placement.affinity, nodes),
        "tolerations": list(placement.tolerations or []),
    }
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if placement.priority_class_name or options.priority_class:
        pod_spec["priorityClassName"] = placement.priority_class_name or options.priority_class
    if options.runtime_class and spec.needs_gpus:
        pod_spec["runtimeClassName"] = options.runtime_class
    if options.service_account:
        pod_spec["serviceAccountName"] = options.service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(cache, constants.agent_daemonset_name(name)),
        "spec": {
            "selector": {"matchLabels": labels(name)},
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": "100%"},
            },
            "template": {
                "metadata": {
                    "labels": labels(name),
                    "annotations": {
                        constants.ANN_EPOCH: str(doc.epoch),
                        ANN_PLAN_HASH: plan_hash(doc),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` holds everything `desired` says (the server may add defaults).

    Dicts compare key by key recursively; lists must have the same length and match element
    by element, so a removed or reordered item counts as drift.
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and contains(actual[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return actual == desired
