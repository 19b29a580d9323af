"""Seeding new replicas with the real kopf operator against kmock (docs/warmup.md).

A source cache gets its token Secret (created, never read back) and mounts it; a cache naming
it in `warmup.seed.from` mounts the source's token and, once the source is Ready, finds the
address of the source's agent of each node rank in its plan, without restarting; a source that
differs or is not Ready only means the Seeding condition says why."""

from __future__ import annotations

import base64
import json
import re

from tests.operator.conftest import NS, eventually
from tests.operator.test_operator import cm_url, ds_url, phase_is
from weightcache import constants as C
from weightcache.contracts import seed as seed_contract

TP16 = {
    "runtime": "vllm",
    "image": "vllm/vllm-openai:v0.33.0",
    "model": {"path": "/models/llama-70b"},
    "parallelism": {"tensor": 16, "nodes": 2},
}
IPS = {"gpu-a": "10.0.0.11", "gpu-b": "10.0.0.12"}


def target(source: str, **spec) -> dict:
    return {**TP16, **spec, "warmup": {"seed": {"from": source}}}


async def seeding(cluster, name: str, reason: str) -> dict:
    async def check():
        cond = next((c for c in (await cluster.status(name)).get("conditions") or []
                     if c["type"] == "Seeding"), None)
        return cond if cond and cond["reason"] == reason else None

    return await eventually(check)


async def plan_of(cluster, name: str) -> dict:
    return json.loads((await cluster.get(cm_url(name)))["data"][C.PLAN_KEY])


def token_volume(ds: dict) -> dict:
    pod = ds["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "secret" in v]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == vol["name"]]
    assert mount == {"name": vol["name"], "mountPath": seed_contract.TOKEN_DIR,
                     "readOnly": True}
    assert "fsGroup" not in pod["securityContext"]  # it would re-own a model PVC
    return vol["secret"]


async def test_a_source_gets_a_token_and_a_target_its_peers_without_a_restart(cluster, operator):
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("old", TP16)
    await cluster.create_cache("new", target("old"))

    # The source: an owned, immutable Secret of 32 random bytes, mounted read-only.
    cond = await seeding(cluster, "old", "Serving")
    assert cond["status"] == "True" and "29700-29715" in cond["message"]
    secret = await eventually(lambda: cluster.get(f"/api/v1/namespaces/{NS}/secrets/old-seed"))
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "WeightCache", "old", (await cluster.cache("old"))["metadata"]["uid"])
    assert secret["immutable"] is True
    token = base64.b64decode(secret["data"][seed_contract.TOKEN_KEY]).decode()
    assert re.fullmatch("[0-9a-f]{64}", token)
    assert token_volume(await cluster.get(ds_url("old"))) == {
        "secretName": "old-seed", "optional": True, "defaultMode": 0o444,
        "items": [{"key": "token", "path": "token"}]}

    # The target mounts the source's token; while the source is not Ready it has no peers.
    cond = await seeding(cluster, "new", "SourceNotReady")
    assert cond["status"] == "False" and "tune by themselves" in cond["message"]
    new_ds = await cluster.get(ds_url("new"))
    assert token_volume(new_ds)["secretName"] == "old-seed"
    assert "seedFrom" not in await plan_of(cluster, "new")
    assert await cluster.get(f"/api/v1/namespaces/{NS}/secrets/new-seed") is None

    # The source becomes Ready: node rank r of the target dials node rank r of the source.
    for pod in await cluster.materialize("old"):
        await cluster.patch(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                            {"status": {"podIP": IPS[pod["spec"]["nodeName"]]}})
    await cluster.set_pods_ready("old")
    await phase_is(cluster, "old", "Ready")
    await seeding(cluster, "new", "SourceReady")
    plan = await plan_of(cluster, "new")
    ranks = {n["node"]: n["rank"] for n in (await cluster.status("old"))["nodes"]}
    assert plan["seedFrom"] == {"cache": "old", "port": 29700, "hosts": sorted(
        ({"rank": ranks[n], "host": ip} for n, ip in IPS.items()), key=lambda h: h["rank"])}
    # Where the source's pods are is no reason to restart the target's agents.
    again = await cluster.get(ds_url("new"))
    assert again["spec"]["template"]["metadata"] == new_ds["spec"]["template"]["metadata"]

    events = {e.get("reason") for e in await cluster.list(f"/api/v1/namespaces/{NS}/events")}
    assert {"SeedServing", "SeedSourceNotReady", "SeedSourceReady"} <= events
    # Create only: the operator never reads a Secret (kmock's request log).
    secrets = [r for r in cluster.kmock if "/secrets" in r.url.path
               and not str(r.headers.get("User-Agent", "")).startswith("kmock/")]
    assert secrets and {str(getattr(r.method, "value", r.method)).upper()
                        for r in secrets} == {"POST"}


async def test_a_source_that_differs_or_is_missing_only_means_no_seeding(cluster, operator):
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("old", TP16)
    await cluster.create_cache("other", target("old", engineArgs={"maxModelLen": 4096}))
    await cluster.create_cache("lost", target("nowhere"))
    await cluster.create_cache("chain", target("other"))
    await cluster.create_cache("single", {**target("old"), "parallelism": {"tensor": 1}})
    cond = await seeding(cluster, "other", "SourceMismatch")
    assert "engineArgs differs" in cond["message"]
    assert "no WeightCache nowhere" in (await seeding(cluster, "lost", "SourceNotFound"))["message"]
    assert "seeds from old itself" in (await seeding(cluster, "chain", "SourceIsATarget"))[
        "message"]
    cond = await seeding(cluster, "single", "NotApplicable")
    assert "world size > 1" in cond["message"]
    for name in ("other", "lost", "chain", "single"):
        await phase_is(cluster, name, "Placing")  # never a failure
        assert "seedFrom" not in await plan_of(cluster, name)
    # World size 1: no token mounted at all.
    pod = (await cluster.get(ds_url("single")))["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "secret" in v]


async def test_a_refused_token_secret_is_a_condition_not_a_failure(cluster, operator, api_guard):
    api_guard.reject.append(
        lambda method, obj: "secrets are refused here" if obj.get("kind") == "Secret" else None)
    for n in ("gpu-a", "gpu-b"):
        await cluster.add_node(n)
    await cluster.create_cache("old", TP16)
    cond = await seeding(cluster, "old", "TokenUnavailable")
    assert cond["status"] == "False" and "secrets are refused here" in cond["message"]
    await phase_is(cluster, "old", "Placing")
    await cluster.materialize("old", ready=True)
    await phase_is(cluster, "old", "Ready")  # seeding never holds the group back
