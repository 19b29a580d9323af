"""The WeightCache CustomResourceDefinition, generated from this one schema source.

`weightcache crds` prints the YAML; `weightcache crds --write DIR` writes
`DIR/weightcache.io_weightcaches.yaml` (a test fails when the committed file drifts).
The spec's schema is generated from the typed API (`weightcache.api.schema`, defaults
included); every field carries a description so `kubectl explain wc.spec...` documents the
API; cross-field rules the schema can express are CEL validations, the rest live in
`spec.validate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from weightcache import constants
from weightcache.api.schema import spec_schema
from weightcache.operator.spec import MAX_NAME_LENGTH, NAME_PATTERN

CRD_FILENAME = f"{constants.GROUP}_{constants.PLURAL}.yaml"
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
        f"A {constants.KIND} keeps one model's weights resident on a group of nodes so restarting "
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
                    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                    "message": f"the name must be at most {MAX_NAME_LENGTH} characters: "
                    "<name>-rendezvous names a Service, and Service names have at most 63",
                },
                {
                    "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
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
        "metadata": {"name": f"{constants.PLURAL}.{constants.GROUP}"},
        "spec": {
            "group": constants.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": constants.KIND,
                "listKind": f"{constants.KIND}List",
                "plural": constants.PLURAL,
                "singular": constants.SINGULAR,
                "shortNames": [constants.SHORT_NAME],
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": constants.VERSION,
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
