"""The Jobs that remove a deleted cache's host directories from each node (docs/warmup.md).

Two directories outlive the cache's pods: the warmup directory, which holds compiled kernels
and autotune tables an engine loads, so it must not outlive its cache (a later cache of
another namespace or uid must never find it); and, for runtime native, the daemons' state
directory (their import set, `resources.daemon_state_dir`), on disk under /var/lib, where
nothing else would ever remove it. The agent cannot do it (it has no API access and cannot
tell a deletion from a restart), so the delete handler starts one Job per node that held the
cache, pinned by `nodeName`, for both:
- init container, as the cache's uid with no capabilities: empties each directory (the
  files are the uid's own, 0700);
- container, as uid 0 with **no** capabilities: removes each now-empty directory from its
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
from weightcache.operator.resources import AgentOptions, daemon_state_dir

PARENT_VOLUME = "parent"
DEADLINE_S = 300
TTL_S = 600
BACKOFF = 2
# Each script takes the directories as its arguments ($0 "$@"): a missing one is done already;
# one that fails does not keep the others from being cleaned, but fails the step. `find -P`
# never follows a symlink, the start point included; a symlinked directory is refused rather
# than emptied.
EMPTY_SCRIPT = ('rc=0; for d in "$0" "$@"; do if test -L "$d"; then rc=1; '
                'elif test -e "$d"; then find "$d" -mindepth 1 -delete || rc=1; fi; done; exit $rc')
REMOVE_SCRIPT = ('rc=0; for d in "$0" "$@"; do test -e "$d" || test -L "$d" || continue; '
                 'rmdir "$d" || rc=1; done; exit $rc')


def labels(name: str) -> dict[str, str]:
    return {constants.LABEL_APP: constants.CLEANUP_APP, constants.LABEL_CLEANUP: name}


def nodes_to_clean(status: Mapping[str, Any], labelled: list[str]) -> list[str]:
    """The nodes that held the cache: those in status.nodes and those still labelled."""
    found = {str(n.get("node")) for n in status.get("nodes") or [] if n.get("node")}
    return sorted(found | set(labelled))


def targets(cache: Mapping[str, Any], spec: WeightCacheSpec) -> list[str]:
    """The cache's host directories that outlive its pods (empty: nothing to clean)."""
    found = [str(spec.warmup.cache_dir)] if spec.warmup.enabled is True else []
    state = daemon_state_dir(cache, spec)
    return found + ([state] if state is not None else [])


def job(cache: Mapping[str, Any], spec: WeightCacheSpec, node: str,
        options: AgentOptions) -> dict[str, Any]:
    """The node's Job removing `targets(cache, spec)` (call only when there are some)."""
    meta = cache["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    dirs = targets(cache, spec)
    # Each directory's parent, mounted at the same path (one volume per distinct parent).
    parents = list(dict.fromkeys(posixpath.dirname(d) for d in dirs))
    volumes = [{"name": f"{PARENT_VOLUME}-{i}", "hostPath": {"path": p, "type": "Directory"}}
               for i, p in enumerate(parents)]
    mount = [{"name": v["name"], "mountPath": v["hostPath"]["path"]} for v in volumes]
    run_as = spec.run_as
    restricted = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
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
                    "volumes": volumes,
                    "initContainers": [{
                        "name": "empty",
                        "image": options.image,
                        "imagePullPolicy": options.image_pull_policy,
                        "command": ["sh", "-c", EMPTY_SCRIPT, *dirs],
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
                        "command": ["sh", "-c", REMOVE_SCRIPT, *dirs],
                        "securityContext": {**restricted, "runAsUser": 0,
                                            "runAsNonRoot": False},
                        "resources": small,
                        "volumeMounts": mount,
                    }],
                },
            },
        },
    }
