"""The WeightCache CustomResourceDefinition, generated from this one schema source.

`weightcache crds` prints the YAML; `weightcache crds --write DIR` writes
`DIR/weightcache.io_weightcaches.yaml` (a test fails when the committed file drifts).
Every field carries a description so `kubectl explain wc.spec...` documents the API; cross-field
rules the schema can express are CEL validations, the rest live in `spec.validate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from weightcache import constants as C
from weightcache.contracts import vocabulary as V
from weightcache.operator import spec as S

CRD_FILENAME = f"{C.GROUP}_{C.PLURAL}.yaml"
PHASES = [
    "Pending", "Placing", "Loading", "Ready", "Degraded", "Invalid", "Unschedulable", "Failed"
]


def _str(description: str, **extra: Any) -> dict:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> dict:
    return {"type": "integer", "description": description, **extra}


def _bool(description: str, **extra: Any) -> dict:
    return {"type": "boolean", "description": description, **extra}


def _obj(description: str, properties: dict, required: list[str] | None = None, **extra) -> dict:
    out = {"type": "object", "description": description, "properties": properties, **extra}
    if required:
        out["required"] = required
    return out


def _free(description: str) -> dict:
    """A core/v1 type kept verbatim (validated by the API server where it is used)."""
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def _port(description: str) -> dict:
    return _int(description, minimum=1, maximum=65535)


def spec_schema() -> dict:
    model = _obj(
        "Where the checkpoint lives. The agent mounts `volume` at `mountPath` and loads `path`.",
        {
            "path": _str(
                "Checkpoint directory inside the mounted volume (absolute, under mountPath), "
                "e.g. /models/llama-3.1-8b.",
                minLength=1,
            ),
            "mountPath": _str(
                "Where the model volume is mounted in the agent container.",
                default=S.DEFAULT_MOUNT_PATH,
                pattern="^/",
            ),
            "volume": _free(
                "Any core/v1 volume source holding the checkpoint, e.g. {hostPath: {path: "
                "/models, type: Directory}} or {persistentVolumeClaim: {claimName: models, "
                "readOnly: true}}. Default: the node's directory at mountPath."
            ),
            "revision": _str(
                "A label for the checkpoint's revision (e.g. a training step). Changing it, or "
                "path, moves the cache to the new revision as updateStrategy says; reported "
                "per node in status."
            ),
        },
        required=["path"],
    )
    engine_args = _obj(
        "Engine arguments passed through to the daemon. They enter the weight fingerprint, so "
        "they must equal the engines' own flags; the webhook warns about mismatches.",
        {
            "dtype": _str("Weight dtype (--dtype).", enum=list(V.DTYPES), default="auto"),
            "quantization": _str("Quantization method (--quantization), e.g. fp8."),
            "revision": _str("Model revision (--revision): branch, tag or commit."),
            "maxModelLen": _int("Maximum model context length (--max-model-len).", minimum=1),
            "speculativeConfig": _free(
                "Speculative decoding config (vLLM --speculative-config JSON); MTP, EAGLE and "
                "EAGLE3 drafts get their own daemon group on ports.draftRendezvous."
            ),
            "extraArgs": {
                "type": "array",
                "description": "Further daemon arguments, one token per item.",
                "items": {"type": "string"},
            },
        },
    )
    parallelism = _obj(
        "The engines' parallel layout; the daemons shard the weights exactly like it.",
        {
            "tensor": _int("Tensor-parallel size (global).", minimum=1, default=1),
            "pipeline": _int(
                "Pipeline-parallel size: must be absent or 1 (the daemon rejects pipeline "
                "parallelism).",
                minimum=1,
                maximum=1,
            ),
            "data": _int("Data-parallel size (global).", minimum=1, default=1),
            "dataLocal": _int(
                "Data-parallel ranks per node (--data-parallel-size-local). Default: "
                "tensor*data/nodes/tensor when a node holds whole TP groups, else 1.",
                minimum=1,
            ),
            "expert": _bool("Expert parallelism (--enable-expert-parallel).", default=False),
            "nodes": _int(
                "Number of nodes in the group; tensor*data must divide evenly over them.",
                minimum=1,
                maximum=S.MAX_NODES,
                default=1,
            ),
        },
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.pipeline) || self.pipeline == 1",
                    "message": "pipeline parallelism is not supported: remove "
                    "spec.parallelism.pipeline or set it to 1",
                }
            ]
        },
    )
    placement = _obj(
        "Which nodes may hold the cache (the operator picks exactly parallelism.nodes of them).",
        {
            "nodeSelector": {
                "type": "object",
                "description": "Labels a node must carry.",
                "additionalProperties": {"type": "string"},
            },
            "tolerations": {
                "type": "array",
                "description": "core/v1 Tolerations of the agent pods (and of placement).",
                "items": _free("A core/v1 Toleration."),
            },
            "affinity": _free(
                "core/v1 Affinity of the agent pods; required node affinity also limits placement."
            ),
            "priorityClassName": _str("PriorityClass of the agent pods."),
        },
    )
    engine = _obj(
        "Defaults injected into opted-in engine pods (per-pod annotations override mode and "
        "fallback).",
        {
            "mode": _str(
                "zero_copy maps the daemon's memory; copy clones it and lets the daemon release.",
                enum=list(V.MODES),
                default="zero_copy",
            ),
            "fallback": _bool(
                "Load from disk when the daemon is unavailable or its fingerprint differs.",
                default=True,
            ),
            "connectTimeoutSeconds": {
                "type": "number",
                "description": "Socket connect timeout in seconds.",
                "minimum": 0,
                "exclusiveMinimum": True,
                "default": 5,
            },
            "stateTimeoutSeconds": {
                "type": "number",
                "description": "Timeout of the weight transfer request in seconds.",
                "minimum": 0,
                "exclusiveMinimum": True,
                "default": 300,
            },
        },
    )
    ports = _obj(
        "Ports of the agent pods (host network is not used; they must differ from each other).",
        {
            "rendezvous": _port("Daemon group rendezvous port (--weight-cache-master-port)."),
            "draftRendezvous": _port(
                "Draft model group rendezvous port (default: rendezvous + 1)."
            ),
            "health": _port("HTTP liveness/readiness port of the agent."),
            "metrics": _port("Prometheus /metrics port of the agent."),
            "grpc": _port("gRPC status/control port of the agent (also the gRPC health service)."),
        },
    )
    run_as = _obj(
        "UID/GID the daemons run as; engines must run as the same UID (the daemon checks the "
        "peer's credentials).",
        {
            "uid": _int("User ID.", minimum=0, default=S.DEFAULT_RUN_AS["uid"]),
            "gid": _int("Group ID.", minimum=0, default=S.DEFAULT_RUN_AS["gid"]),
        },
    )
    return _obj(
        "The desired cache: one model, one layout, one group of nodes.",
        {
            "runtime": _str(
                "vllm runs the official `vllm preload` from the engines' image; native runs this "
                "project's daemon (torch + safetensors) and serves any PyTorch consumer.",
                enum=list(V.RUNTIMES),
            ),
            "image": _str(
                "For vllm: the engines' vLLM image, pinned by tag or digest (the fingerprint "
                "includes the vLLM version). For native: an optional agent image override."
            ),
            "device": _str(
                "Native runtime only: cuda (default) or cpu (no GPU needed).", enum=list(V.DEVICES)
            ),
            "model": model,
            "engineArgs": engine_args,
            "shardRules": {
                "type": "array",
                "description": "Native runtime only: tensor-parallel shard rules REGEX=DIM "
                "(default: the built-in Llama preset).",
                "items": {"type": "string", "pattern": "^.+=-?[0-9]+$"},
            },
            "parallelism": parallelism,
            "gpusPerNode": _int(
                "GPUs each chosen node must have and the cache uses. Default: tensor*data/nodes. "
                "A dense single-node model with fewer ranks than this fills the node with "
                "independent replicas.",
                minimum=1,
                maximum=S.MAX_GPUS_PER_NODE,
            ),
            "placement": placement,
            "updateStrategy": _obj(
                "How a new model revision (spec.model.path or revision) reaches a running "
                "cache. InPlace (default, runtime native): the daemons write the new revision "
                "into their existing memory while engines pause, keeping every address; "
                "refused (and reported) when the tensor layout differs. Recreate: restart the "
                "group on the new revision (what runtime vllm always does).",
                {"type": _str("InPlace or Recreate.", enum=list(S.UPDATE_STRATEGIES),
                              default="InPlace")},
            ),
            "socketDir": _str(
                "Absolute host directory of the daemons' Unix sockets (mounted into engine "
                "pods). Default: /var/run/weightcache/<namespace>/<name>.",
                pattern="^/",
            ),
            "engine": engine,
            "ports": ports,
            "resources": _free(
                "core/v1 ResourceRequirements of the agent container. No GPU requests are "
                "added: the agent sees every GPU of its node."
            ),
            "runAs": run_as,
        },
        required=["runtime", "model"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "self.runtime != 'vllm' || has(self.image)",
                    "message": "runtime vllm needs spec.image: the engines' vLLM image",
                },
                {
                    "rule": "self.runtime == 'native' || !has(self.device)",
                    "message": "spec.device applies to runtime native only",
                },
                {
                    "rule": "self.runtime == 'native' || !has(self.shardRules)",
                    "message": "spec.shardRules applies to runtime native only",
                },
            ]
        },
    )


# metav1.Condition's own validation (apimachinery pkg/apis/meta/v1/validation ValidateCondition,
# the same bounds as its OpenAPI markers): reason CamelCase-ish, message <= 32768.
CONDITION_REASON_PATTERN = "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
CONDITION_MESSAGE_MAX = 32768


def _condition() -> dict:
    return _obj(
        "A standard condition (Kubernetes API conventions, metav1.Condition).",
        {
            "type": _str("Ready, Progressing, Degraded or Updating.", maxLength=316),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str(
                "CamelCase reason.", minLength=1, maxLength=1024, pattern=CONDITION_REASON_PATTERN
            ),
            "message": _str("Human-readable detail.", maxLength=CONDITION_MESSAGE_MAX),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": _int("The generation the condition describes.", minimum=0),
        },
        required=["type", "status", "reason", "lastTransitionTime"],
    )


def status_schema() -> dict:
    node_entry = _obj(
        "One placed node.",
        {
            "node": _str("Node name."),
            "rank": _int("Node rank (0 hosts the rendezvous)."),
            "ranksReady": _int("Ready daemon ranks on this node."),
            "ranksTotal": _int("Daemon ranks on this node."),
            "ready": _bool("Whether the node's agent pod is Ready."),
            "pod": _str("The agent pod on this node."),
            "restarts": _int("Container restarts of that pod (a restart restarts the group)."),
            "generation": _int("In-place update generation its daemons serve (1: as loaded)."),
            "revision": _str("spec.model.revision its daemons serve."),
        },
    )
    return _obj(
        "Observed state, written by the operator.",
        {
            "phase": _str("Summary of the state.", enum=PHASES),
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing, Degraded and (after a revision change) "
                "Updating conditions.",
                "items": _condition(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "observedGeneration": _int("The spec generation the status describes."),
            "epoch": _int("Group epoch; bumped when the group is re-placed or restarted."),
            "ranksReady": _int("Ready daemon ranks in the group."),
            "ranksTotal": _int("Daemon ranks in the group."),
            "ranks": _str("ranksReady/ranksTotal, for kubectl get."),
            "bytesCached": _int("Bytes of weights held by the group (when the agents report it)."),
            "readyNodes": _int("Placed nodes whose agent pod is Ready."),
            "nodes": {"type": "array", "description": "Placed nodes by rank.", "items": node_entry},
            "message": _str("The latest problem, if any, in one line."),
            "model": _obj(
                "The model revision the group serves (it trails spec.model while an update "
                "runs or after one was refused).",
                {"path": _str("Checkpoint directory."), "revision": _str("Revision label.")},
            ),
            "podSecurity": _str(
                "The Pod Security level the namespace enforces "
                "(pod-security.kubernetes.io/enforce), when it is not privileged: agents and "
                "engine pods with the injected socket mount need privileged (hostPath)."
            ),
        },
    )


def crd() -> dict:
    """The full CustomResourceDefinition object."""
    schema = _obj(
        f"A {C.KIND} keeps one model's weights resident on a group of nodes so restarting "
        "inference engines map them instead of reloading them from disk.",
        {
            "apiVersion": _str("API version: weightcache.io/v1alpha1."),
            "kind": _str("WeightCache."),
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": f"size(self.metadata.name) <= {S.MAX_NAME_LENGTH}",
                    "message": f"the name must be at most {S.MAX_NAME_LENGTH} characters: "
                    "<name>-rendezvous names a Service, and Service names have at most 63",
                },
                {
                    "rule": f"self.metadata.name.matches('{S.NAME_PATTERN}')",
                    "message": "the name must start with a lowercase letter and hold only "
                    "lowercase letters, digits and '-': <name>-rendezvous names a Service, and "
                    "Service names are DNS-1035 labels",
                },
            ]
        },
    )
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ranks", "type": "string", "jsonPath": ".status.ranks"},
        {"name": "Nodes", "type": "integer", "jsonPath": ".spec.parallelism.nodes"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.path"},
        {"name": "Runtime", "type": "string", "jsonPath": ".spec.runtime", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{C.PLURAL}.{C.GROUP}"},
        "spec": {
            "group": C.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": C.KIND,
                "listKind": f"{C.KIND}List",
                "plural": C.PLURAL,
                "singular": C.SINGULAR,
                "shortNames": [C.SHORT_NAME],
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": C.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `weightcache crds --write crds/` from operator/crd.py.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="weightcache crds", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", help=f"write DIR/{CRD_FILENAME}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        path = Path(args.write) / CRD_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    else:
        sys.stdout.write(text)
    return 0
