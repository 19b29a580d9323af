"""A DRA ResourceClaimTemplate (resource.k8s.io/v1) that can only be met by cached shards.

With a device plugin the engine takes whichever GPUs it is given and the alignment code makes
the best of them; with DRA the claim itself can ask for the right GPUs. The NVIDIA DRA driver
publishes every full GPU as a device with the attribute `uuid` under its domain
`gpu.nvidia.com` (NVIDIA/k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/deviceinfo.go,
`GpuInfo.GetDevice`: type, uuid, productName, brand, architecture, cudaComputeCapability,
driverVersion, cudaDriverVersion, pcieBusID, addressingMode), and a device request's CEL
selector sees it as `device.attributes["gpu.nvidia.com"].uuid`. So the template has one
request per tp_rank, each selecting exactly one GPU whose UUID is among those holding that
tp_rank. The scheduler allocates a claim's devices on the one node the pod runs on, so every
allocation it can make covers every tp_rank on one node; the engine's start-up code then
orders CUDA_VISIBLE_DEVICES by UUID as usual (weightcache.contracts.alignment).

Limits (docs/alignment.md, "DRA"): a CEL expression is at most 10 Ki characters
(resource.k8s.io/v1 CELDeviceSelector), which bounds how many GPUs one selector can list
(~230 UUIDs per tp_rank); the UUIDs come from the agents (gRPC Status `Rank.gpu_uuid`), and
a group that moves to other GPUs needs a new template. Pure functions: the caller creates
the object and points engine pods at it (`spec.resourceClaims`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from weightcache.errors import ProjectError

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
MAX_CEL_CHARS = 10 * 1024  # "The length of the expression must be smaller or equal to 10 Ki."


class ClaimError(ProjectError, ValueError):
    """No valid template exists for these GPUs; the message says why."""


def rank_selector(uuids: Iterable[str], driver: str = DRIVER) -> str:
    """CEL: the device is one of `uuids` of `driver` (a full GPU, not a MIG slice)."""
    listed = json.dumps(sorted(set(uuids)), separators=(",", ":"))
    return (f'device.driver == "{driver}" && device.attributes["{driver}"].type == "gpu" '
            f'&& device.attributes["{driver}"].uuid in {listed}')


def aligned_claim_template(
    name: str,
    namespace: str,
    tp_size: int,
    gpus: Mapping[str, int],
    *,
    device_class: str = DEVICE_CLASS,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The template for engines of one cache: `gpus` maps GPU UUID -> the tp_rank it holds."""
    if tp_size < 1:
        raise ClaimError(f"tensor-parallel size must be >= 1, got {tp_size}")
    requests = []
    for rank in range(tp_size):
        holders = [u for u, r in gpus.items() if r == rank]
        if not holders:
            raise ClaimError(f"no GPU holds tp_rank {rank} of {tp_size}: nothing could satisfy "
                             f"the claim")
        expression = rank_selector(holders)
        if len(expression) > MAX_CEL_CHARS:
            raise ClaimError(
                f"tp_rank {rank} is held by {len(holders)} GPUs; listing them takes "
                f"{len(expression)} characters, more than the {MAX_CEL_CHARS} a CEL selector "
                f"may have: split the template per node pool"
            )
        requests.append({
            "name": f"tp-rank-{rank}",
            "exactly": {
                "deviceClassName": device_class,
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": expression}}],
            },
        })
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = dict(labels)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": meta,
        "spec": {"spec": {"devices": {"requests": requests}}},
    }
