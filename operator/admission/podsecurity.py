"""Admission warnings for engine pods a namespace's Pod Security level will refuse.

The injected socket mount is a hostPath volume, which Pod Security `baseline` forbids for both
runtimes (runtime vllm also injects hostIPC). The operator records the level a cache's namespace
enforces in `status.podSecurity`; injection calls `engine_warnings` with it, so the user sees
why the pod is about to be refused instead of a bare PodSecurity denial.
"""

from __future__ import annotations

from weightcache.operator import podsecurity


def engine_warnings(level: str | None, runtime: str, namespace: str) -> list[str]:
    """Warnings for an engine pod injected for a cache whose namespace enforces `level`."""
    if not level or level == podsecurity.PRIVILEGED:
        return []
    return [
        f"namespace {namespace} enforces Pod Security level {level!r}: the injected "
        f"{' and '.join(podsecurity.engine_needs(runtime))} need {podsecurity.PRIVILEGED!r}, so "
        f"this pod will be refused; label the namespace "
        f"{podsecurity.ENFORCE_LABEL}={podsecurity.PRIVILEGED}"
    ]
