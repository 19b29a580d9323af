"""The Jobs that remove a deleted cache's warmup directory from each node (docs/warmup.md).

The directory holds compiled kernels and autotune tables an engine loads, so it must not
outlive its cache: a later cache of another namespace or uid must never find it. The agent
cannot do it (it has no API access and cannot tell a deletion from a restart), so the delete
handler starts one Job per node that held the cache, pinned by `nodeName`:
- init container, as the cache's uid with no capabilities: empties `<cacheDir>` (the files
  are the uid's own, 0700);
- container, as uid 0 with **no** capabilities: removes the now-empty `<cacheDir>` from its
  parent, which root owns (no DAC override needed).
The finalizer does not wait for the Jobs (a dead node would block the deletion forever);
`ttlSecondsAfterFinished` removes them, `activeDeadlineSeconds` bounds a Job that cannot run.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from weightcache import constants
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator.resources import AgentOptions

PARENT_VOLUME = "warmup-parent"
DEADLINE_S = 300
TTL_S = 600
BACKOFF = 2
# `find -P` never follows a symlink, the start point included; a symlinked directory is
# refused rather than emptied.
EMPTY_SCRIPT = ('test -e "$0" || test -L "$0" || exit 0; test -L "$0" && exit 1; '
                'find "$0" -mindepth 1 -delete')
REMOVE_SCRIPT = 'test -e "$0" || test -L "$0" || exit 0; rmdir "$0"'


def labels(name: str) -> dict[str, str]:
    return {constants.LABEL_APP: constants.CLEANUP_APP, constants.LABEL_CLEANUP: name}


def nodes_to_clean(status: Mapping[str, Any], labelled: list[str]) -> list[str]:
    """The nodes that held the cache: those in status.nodes and those still labelled."""
    found = {str(n.get("node")) for n in status.get("nodes") or [] if n.get("node")}
    return sorted(found | set(labelled))


def job(cache: Mapping[str, Any], spec: WeightCacheSpec, node: str,
        options: AgentOptions) -> dict[str, Any]:
    meta = cache["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    target = str(spec.warmup.cache_dir)
    parent = posixpath.dirname(target)
    run_as = spec.run_as
    restricted = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    mount = [{"name": PARENT_VOLUME, "mountPath": parent}]
    small = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    pod_labels = labels(name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": constants.cleanup_job_name(name, node, str(meta.get("uid", ""))),
                     "namespace": namespace, "labels": pod_labels},
        "spec": {
            "backoffLimit": BACKOFF,
            "activeDeadlineSeconds": DEADLINE_S,
            "ttlSecondsAfterFinished": TTL_S,
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": list(spec.placement.tolerations or []),
                    "volumes": [{"name": PARENT_VOLUME,
                                 "hostPath": {"path": parent, "type": "Directory"}}],
                    "initContainers": [{
                        "name": "empty",
                        "image": options.image,
                        "imagePullPolicy": options.image_pull_policy,
                        "command": ["sh", "-c", EMPTY_SCRIPT, target],
                        "securityContext": {**restricted, "runAsUser": run_as.uid,
                                            "runAsGroup": run_as.gid,
                                            "runAsNonRoot": run_as.uid != 0},
                        "resources": small,
                        "volumeMounts": mount,
                    }],
                    "containers": [{
                        "name": "remove",
                        "image": options.image,
                        "imagePullPolicy": options.image_pull_policy,
                        "command": ["sh", "-c", REMOVE_SCRIPT, target],
                        "securityContext": {**restricted, "runAsUser": 0,
                                            "runAsNonRoot": False},
                        "resources": small,
                        "volumeMounts": mount,
                    }],
                },
            },
        },
    }
