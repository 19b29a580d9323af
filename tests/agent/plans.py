"""Plan documents for agent tests, shaped like the operator's placement ConfigMap."""

from __future__ import annotations

import json
from typing import Any


def make_plan(
    *,
    runtime: str = "vllm",
    tensor: int = 1,
    data: int = 1,
    nodes: int = 1,
    expert: bool = False,
    model: str = "/models/llama",
    spec_extra: dict[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    epoch: int = 1,
    cache: str = "llama",
    namespace: str = "default",
) -> dict[str, Any]:
    world = tensor * data
    spec: dict[str, Any] = {
        "runtime": runtime,
        "model": {"path": model, "mountPath": "/models"},
        "engineArgs": dict(engine_args or {}),
        "parallelism": {"tensor": tensor, "data": data, "expert": expert, "nodes": nodes,
                        "pipeline": 1},
        "ports": {"rendezvous": 29600, "draftRendezvous": 29601, "health": 8478,
                  "metrics": 9478, "grpc": 9479},
    }
    spec.update(spec_extra or {})
    return {
        "cache": cache,
        "namespace": namespace,
        "uid": "0b8f-uid",
        "epoch": epoch,
        "runtime": runtime,
        "masterAddr": f"{cache}-rendezvous.{namespace}.svc",
        "nodeCount": nodes,
        "gpusPerNode": world // nodes,
        "nodes": [{"node": f"gpu-{chr(ord('a') + i)}", "rank": i} for i in range(nodes)],
        "layout": {"tensor": tensor, "data": data, "dataLocal": max(data // nodes, 1),
                   "expert": expert, "worldSize": world, "replicasPerNode": 1},
        "spec": spec,
    }


def dumps(plan: dict[str, Any]) -> str:
    return json.dumps(plan)


def gpu_uuids(n: int, node: int = 0) -> list[str]:
    return [f"GPU-{node:02x}{i:02x}aaaa-0000-1111-2222-33334444{i:04x}" for i in range(n)]
