"""The DRA claim template: valid resource.k8s.io/v1, and its CEL selects exactly the right GPUs.

Schema: kubernetes-validate's resource.k8s.io/v1 ResourceClaimTemplate (Kubernetes 1.35,
strict). Selection: the selector is evaluated by a CEL implementation (cel-python) over
devices shaped as the NVIDIA DRA driver publishes them (attributes under `gpu.nvidia.com`:
`type`, `uuid`, `productName`, ...; NVIDIA/k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/
deviceinfo.go), with the `device` variable the API documents for CEL device selectors
(`driver`, `attributes[domain]`).
"""

from __future__ import annotations

import pytest

from weightcache.operator import dra


def uuids(node: int, n: int = 8) -> list[str]:
    return [f"GPU-{node:02x}{i:02x}bbbb-0000-1111-2222-33334444{i:04x}" for i in range(n)]


def published_devices(node: int) -> list[dict]:
    """One node's ResourceSlice devices as CEL sees them (8 GPUs and a MIG slice)."""
    out = [{"driver": dra.DRIVER, "attributes": {dra.DRIVER: {
        "type": "gpu", "uuid": u, "productName": "NVIDIA H200", "pcieBusID": f"0000:{i:02x}:00.0",
    }}} for i, u in enumerate(uuids(node))]
    out.append({"driver": dra.DRIVER, "attributes": {dra.DRIVER: {
        "type": "mig", "uuid": uuids(node)[0], "parentUUID": uuids(node)[0]}}})
    out.append({"driver": "other.example.com", "attributes": {"other.example.com": {}}})
    return out


def held(tp: int, nodes: int) -> dict[str, int]:
    return {u: i % tp for n in range(nodes) for i, u in enumerate(uuids(n))}


def test_template_is_valid_resource_v1() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    obj = dra.aligned_claim_template("llama-tp4", "serving", 4, held(4, 2),
                                     labels={"weightcache.io/cache": "llama"})
    kubernetes_validate.validate(obj, "1.35", strict=True)
    reqs = obj["spec"]["spec"]["devices"]["requests"]
    assert [r["name"] for r in reqs] == ["tp-rank-0", "tp-rank-1", "tp-rank-2", "tp-rank-3"]
    assert all(r["exactly"]["count"] == 1 for r in reqs)


def test_each_request_selects_only_gpus_holding_its_rank() -> None:
    celpy = pytest.importorskip("celpy", reason="pip install cel-python (test extra)")
    env = celpy.Environment()
    obj = dra.aligned_claim_template("llama-tp2", "serving", 2, held(2, 2))
    for rank, req in enumerate(obj["spec"]["spec"]["devices"]["requests"]):
        program = env.program(env.compile(req["exactly"]["selectors"][0]["cel"]["expression"]))
        chosen = []
        for node in range(3):  # node 2 is not in the group: its GPUs must never match
            for device in published_devices(node):
                if bool(program.evaluate({"device": celpy.json_to_cel(device)})):
                    chosen.append((node, device["attributes"][dra.DRIVER]["uuid"]))
        want = [(n, u) for n in range(2) for i, u in enumerate(uuids(n)) if i % 2 == rank]
        assert chosen == want


def test_limits_are_clear_errors() -> None:
    with pytest.raises(dra.ClaimError, match="no GPU holds tp_rank 2 of 4"):
        dra.aligned_claim_template("x", "ns", 4, held(2, 1))
    with pytest.raises(dra.ClaimError, match="more than the 10240 a CEL selector"):
        dra.aligned_claim_template("x", "ns", 2, held(2, 60))  # 240 GPUs per rank
    assert len(dra.rank_selector(uuids(0) * 1)) < dra.MAX_CEL_CHARS
