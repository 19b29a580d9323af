"""Webhook half of GPU alignment for vLLM engines: make the engine run the alignment code.

The webhook cannot know which GPUs the device plugin will give the pod, so it arranges for
the decision to happen inside the container, at Python start-up: the agent publishes
`<socket_dir>/python/sitecustomize.py` (weightcache.contracts.alignment), and this module
puts that folder on the engine's PYTHONPATH with the engine's parallel sizes. Why not wrap the
command: a `vllm serve` driven by the image's entrypoint (args only) has no command we could
wrap without guessing the entrypoint, and wrapping would change how the pod's command line
reads to everything else (our own re-admission included). Every vLLM process is Python, so
sitecustomize covers `vllm serve`, `python -m vllm.entrypoints...`, `sh -c` scripts and the
entrypoint alike. An init container cannot work: it cannot set another container's environment.

What it cannot cover, each said as an admission warning: a pod that sets CUDA_VISIBLE_DEVICES
itself (its order is kept), a PYTHONPATH from valueFrom (not rewritten). Documented in
docs/alignment.md: an image whose Dockerfile sets PYTHONPATH loses it (the pod's variable
replaces the image's), and `python -S`/`-I` skips site customisation (the engine starts
unaligned, which costs a disk load, never a failed start).
"""

from __future__ import annotations

from typing import Any

from weightcache.contracts import alignment as al
from weightcache.operator.admission.cmdline import flag_values

ALIGN_FLAGS_TP = ("--tensor-parallel-size", "-tp")
ALIGN_FLAGS_DP_LOCAL = ("--data-parallel-size-local", "-dpl")
ALIGN_FLAGS_DP_START = ("--data-parallel-start-rank", "-dpr")
ALIGN_FLAGS_EP = ("--enable-expert-parallel", "-ep")


def python_dir(socket_dir: str) -> str:
    return f"{socket_dir.rstrip('/')}/{al.PYTHON_DIR}"


def inject_alignment(container: dict[str, Any], tokens: list[str], cache: Any, res: Any) -> None:
    """Add the alignment environment to a vLLM engine container (idempotent).

    `cache` is the webhook's CacheView, `res` its Result (warnings are appended to it).
    """
    if cache.runtime != "vllm" or cache.tensor <= 1:
        return  # a TP=1 replica hits on whichever GPU it gets
    tp = (flag_values(tokens, *ALIGN_FLAGS_TP) or ["1"])[-1]
    if tp != str(cache.tensor):
        return  # the TP mismatch is already a warning; no shard would match anyway
    name = container.get("name")
    env = list(container.get("env") or [])
    by_name = {e.get("name"): e for e in env}
    if "CUDA_VISIBLE_DEVICES" in by_name:
        res.warnings.append(
            f"container {name!r} sets CUDA_VISIBLE_DEVICES, so the weight cache keeps that GPU "
            f"order: unless it happens to list GPUs in tp_rank order, its ranks load from disk"
        )
        return
    folder = python_dir(cache.socket_dir)
    current = by_name.get("PYTHONPATH")
    if current is not None and "value" not in current:
        res.warnings.append(
            f"container {name!r} takes PYTHONPATH from valueFrom, which the webhook cannot "
            f"extend with {folder}: GPU alignment is off and ranks the device plugin places "
            f"on GPUs holding other shards load from disk"
        )
        return
    wanted = {
        al.ENV_SOCKET_DIR: cache.socket_dir,
        al.ENV_TP: tp,
        al.ENV_DP_LOCAL: (flag_values(tokens, *ALIGN_FLAGS_DP_LOCAL) or ["1"])[-1],
    }
    if any(t in ALIGN_FLAGS_EP for t in tokens):  # expert shards differ per DP rank
        wanted[al.ENV_DP_START] = (flag_values(tokens, *ALIGN_FLAGS_DP_START) or ["0"])[-1]
    added = [{"name": k, "value": v} for k, v in wanted.items() if k not in by_name]
    if "POD_NAME" not in by_name:
        added.append({"name": "POD_NAME",
                      "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    if current is None:
        added.append({"name": "PYTHONPATH", "value": folder})
    elif folder not in str(current.get("value") or "").split(":"):
        value = current.get("value") or ""
        env[env.index(current)] = {"name": "PYTHONPATH",
                                   "value": f"{folder}:{value}" if value else folder}
    if added or env != list(container.get("env") or []):
        container["env"] = env + added
