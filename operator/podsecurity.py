"""Pod Security admission as it affects a cache: levels its pods need, what namespaces enforce.

The built-in PodSecurity admission plugin rejects pods that break the level a namespace enforces
(label `pod-security.kubernetes.io/enforce`; unlabelled means `privileged`). Its `baseline` level
forbids hostPath volumes and host namespaces (k8s.io/pod-security-admission, policy
check_hostPathVolumes.go and check_hostNamespaces.go). Every agent pod mounts the socket
directory from the host, and every engine pod the webhook injects mounts it too, for both
runtimes (the warmup directory as well while `spec.warmup.enabled`); runtime `native` agents
also mount their daemons' state directory (never engines), runtime `vllm` agents use hostPID
and hostIPC and its engines hostIPC. So a cache works only in a namespace at `privileged`. The
reconciler reads the namespace's label to say so in status before any pod is refused, and
recognises the DaemonSet controller's refusals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
PRIVILEGED = "privileged"
LEVELS = (PRIVILEGED, "baseline", "restricted")
# The PodSecurity plugin's denial text ("... is forbidden: violates PodSecurity ...").
DENIAL_MARKER = "violates PodSecurity"


def enforced_level(namespace: Mapping[str, Any] | None) -> str:
    """The level a Namespace object enforces (`privileged` without the label)."""
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    level = str(labels.get(ENFORCE_LABEL) or PRIVILEGED)
    return level if level in LEVELS else PRIVILEGED


def agent_needs(runtime: str) -> list[str]:
    """What in an agent pod needs the `privileged` level (the checks `baseline` fails)."""
    dirs = "the socket and warmup directories shared with engines"
    if runtime == "native":
        dirs += ", the daemons' state directory"
    needs = [f"hostPath volumes ({dirs})"]
    if runtime == "vllm":
        needs.append("hostPID and hostIPC (stock vLLM CUDA IPC)")
    return needs


def engine_needs(runtime: str) -> list[str]:
    """What the webhook injects into engine pods that needs the `privileged` level."""
    needs = ["hostPath volumes (the cache's socket and warmup directories)"]
    if runtime == "vllm":
        needs.append("hostIPC (stock vLLM CUDA IPC)")
    return needs


def blocked_message(namespace: str, level: str, runtime: str) -> str:
    """One line for status and events: why agents are refused and how to fix it."""
    return (
        f"namespace {namespace} enforces Pod Security level {level!r} ({ENFORCE_LABEL}); agent "
        f"pods need {PRIVILEGED!r} for {' and '.join(agent_needs(runtime))}: label the "
        f"namespace {ENFORCE_LABEL}={PRIVILEGED}, or exempt it in the PodSecurity admission "
        "configuration"
    )


def is_denial(message: str) -> bool:
    return DENIAL_MARKER in message
