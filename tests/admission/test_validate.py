"""Validating webhook for WeightCaches over real HTTPS: every rule the schema cannot express."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.admission.conftest import cache_obj
from weightcache.testing.webhook import LocalWebhook


def verdict(webhook: LocalWebhook, obj: dict, old: dict | None = None) -> dict:
    op = "UPDATE" if old is not None else "CREATE"
    return webhook.review(obj, resource="weightcaches", operation=op, old=old)["response"]


def denied(webhook: LocalWebhook, obj: dict, old: dict | None = None) -> str:
    out = verdict(webhook, obj, old)
    assert out["allowed"] is False
    assert out["status"]["code"] == 422
    return out["status"]["message"]


@pytest.mark.parametrize(
    "spec",
    [
        {"runtime": "native", "model": {"path": "/models/llama"}},
        {"runtime": "native", "device": "cpu", "model": {"path": "/models/llama"}},
        {
            "runtime": "vllm",
            "image": "vllm/vllm-openai:v0.31.0",
            "model": {
                "path": "/models/llama",
                "volume": {"persistentVolumeClaim": {"claimName": "m"}},
            },
            "parallelism": {"tensor": 16, "nodes": 2},
            "gpusPerNode": 8,
        },
        {
            "runtime": "vllm",
            "image": "vllm/vllm-openai:v0.31.0",
            "model": {"path": "/models/ds"},
            "parallelism": {"tensor": 1, "data": 16, "dataLocal": 4, "expert": True, "nodes": 4},
            "gpusPerNode": 4,
        },
        {
            "runtime": "native",
            "model": {"path": "/models/l"},
            "parallelism": {"tensor": 2},
            "gpusPerNode": 8,
        },
    ],
    ids=["native", "native-cpu", "tp16-2-nodes", "tp1-dp16-ep-4-nodes", "tp2-filling-8-gpus"],
)
def test_valid_specs_are_allowed(webhook: LocalWebhook, spec: dict) -> None:
    obj = cache_obj(**{"name": "ok"})
    obj["spec"] = spec
    out = verdict(webhook, obj)
    assert out["allowed"] is True, out.get("status")


RULES: list[tuple[str, dict, str, str]] = [
    # (id, spec overrides, field named, words of the fix)
    (
        "vllm-needs-image",
        {"runtime": "vllm", "image": None},
        "spec.image",
        "needs the engines' vLLM image",
    ),
    (
        "vllm-image-unpinned",
        {"image": "vllm/vllm-openai:latest"},
        "spec.image",
        "use the exact tag or digest",
    ),
    (
        "pipeline",
        {"parallelism": {"pipeline": 2}},
        "spec.parallelism.pipeline",
        "use tensor, data or expert parallelism",
    ),
    (
        "nodes-do-not-divide",
        {"parallelism": {"tensor": 8, "nodes": 3}},
        "spec.parallelism.nodes",
        "choose nodes that divide 8",
    ),
    (
        "gpus-per-node-too-small",
        {"parallelism": {"tensor": 16, "nodes": 2}, "gpusPerNode": 4},
        "spec.gpusPerNode",
        "set gpusPerNode to 8",
    ),
    (
        "multi-node-extra-gpus",
        {"parallelism": {"tensor": 16, "nodes": 2}, "gpusPerNode": 16},
        "spec.gpusPerNode",
        "uses exactly 8 GPUs per node",
    ),
    (
        "tp-not-whole-nodes",
        {"parallelism": {"tensor": 4, "data": 3, "nodes": 2}},
        "spec.parallelism.tensor",
        "tensor divides",
    ),
    (
        "ports-collide",
        {"ports": {"rendezvous": 9000, "draftRendezvous": 9000}},
        "spec.ports.draftRendezvous",
        "already used by spec.ports.rendezvous",
    ),
    (
        "health-metrics-collide",
        {"ports": {"health": 9478}},
        "spec.ports.metrics",
        "give each port its own number",
    ),
    (
        "socket-dir-relative",
        {"socketDir": "run/weightcache"},
        "spec.socketDir",
        "must be an absolute host path",
    ),
    ("socket-dir-system", {"socketDir": "/etc/weightcache"}, "spec.socketDir", "is a system path"),
    (
        "pvc-without-claim",
        {"model": {"path": "/models/l", "volume": {"persistentVolumeClaim": {}}}},
        "spec.model.volume.persistentVolumeClaim.claimName",
        "name the claim",
    ),
    (
        "emptydir-model",
        {"model": {"path": "/models/l", "volume": {"emptyDir": {}}}},
        "spec.model.volume.emptyDir",
        "use hostPath, persistentVolumeClaim",
    ),
    (
        "model-outside-mount",
        {"model": {"path": "/data/l"}},
        "spec.model.path",
        "lies outside the model volume",
    ),
    (
        "bad-mode",
        {"engine": {"mode": "shared"}},
        "spec.engine.mode",
        "must be one of zero_copy, copy",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "field", "fix"), [r[1:] for r in RULES], ids=[r[0] for r in RULES]
)
def test_each_rule_denies_naming_field_and_fix(
    webhook: LocalWebhook, overrides: dict, field: str, fix: str
) -> None:
    obj = cache_obj(name="bad")
    obj["spec"].update(copy.deepcopy(overrides))
    obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
    msg = denied(webhook, obj)
    assert f"{field}: " in msg
    assert fix in msg


def test_several_problems_are_reported_together(webhook: LocalWebhook) -> None:
    obj = cache_obj(name="bad")
    obj["spec"].update({"socketDir": "relative", "parallelism": {"pipeline": 4}})
    msg = denied(webhook, obj)
    assert "spec.socketDir: " in msg and "spec.parallelism.pipeline: " in msg


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"runtime": "native", "image": None}, "spec.runtime"),
        ({"socketDir": "/var/run/weightcache/other"}, "spec.socketDir"),
        ({"runAs": {"uid": 0, "gid": 0}}, "spec.runAs"),
    ],
)
def test_immutable_fields_on_update(webhook: LocalWebhook, change: dict, field: str) -> None:
    old = cache_obj(name="imm")
    new = copy.deepcopy(old)
    new["spec"].update(change)
    new["spec"] = {k: v for k, v in new["spec"].items() if v is not None}
    msg = denied(webhook, new, old)
    assert f"{field}: is immutable" in msg
    assert "create a new WeightCache" in msg


def test_default_made_explicit_is_not_a_change(webhook: LocalWebhook) -> None:
    old = cache_obj(name="imm")
    new = copy.deepcopy(old)
    new["spec"]["socketDir"] = "/var/run/weightcache/serving/imm"
    new["spec"]["runAs"] = {"uid": 1000, "gid": 1000}
    assert verdict(webhook, new, old)["allowed"] is True


def test_mutable_fields_update(webhook: LocalWebhook) -> None:
    old = cache_obj(name="mut")
    new: dict[str, Any] = copy.deepcopy(old)
    new["spec"]["model"]["path"] = "/models/llama-3.2-8b"
    new["spec"]["image"] = "vllm/vllm-openai:v0.32.0"
    new["spec"]["engine"] = {"mode": "copy"}
    assert verdict(webhook, new, old)["allowed"] is True


def _invalid_cache(name: str) -> dict:
    """A cache the webhook would deny on create (it got in while the webhook failed open)."""
    obj = cache_obj(name=name)
    obj["spec"]["parallelism"] = {"tensor": 3, "nodes": 2}  # 3 ranks cannot split over 2 nodes
    return obj


def test_item2_invalid_cache_is_denied_on_create(webhook: LocalWebhook) -> None:
    assert "spec.parallelism" in denied(webhook, _invalid_cache("bad"))


@pytest.mark.parametrize(
    "change",
    ["add-finalizer", "remove-finalizer", "labels", "status", "deleting"],
)
def test_item2_metadata_finalizer_and_status_updates_are_always_admitted(
    webhook: LocalWebhook, change: str
) -> None:
    """Item 2: an invalid cache can still get and lose its finalizer, so it can be deleted.

    A validating webhook sees every UPDATE, kopf's finalizer patches and an admin's manual
    finalizer removal included; denying them made such a cache undeletable.
    """
    old = _invalid_cache(f"fin-{change}")
    new = copy.deepcopy(old)
    meta = new["metadata"]
    if change == "add-finalizer":
        meta["finalizers"] = ["weightcache.io/finalizer"]
    elif change == "remove-finalizer":
        old["metadata"]["finalizers"] = ["weightcache.io/finalizer"]
        meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"] = "2026-12-01T08:00:00Z"
    elif change == "labels":
        meta["labels"] = {"team": "ml"}
    elif change == "status":
        new["status"] = {"phase": "Invalid", "message": "spec.parallelism: ..."}
    else:  # a spec change while the object is being deleted
        meta["deletionTimestamp"] = "2026-12-01T08:00:00Z"
        new["spec"]["model"]["path"] = "/models/other"
    out = verdict(webhook, new, old)
    assert out["allowed"] is True, out


def test_item2_delete_is_admitted(webhook: LocalWebhook) -> None:
    obj = _invalid_cache("del")
    out = webhook.review(None, resource="weightcaches", operation="DELETE", old=obj)["response"]
    assert out["allowed"] is True


def test_item2_a_spec_change_of_an_invalid_cache_is_still_judged(webhook: LocalWebhook) -> None:
    old = _invalid_cache("still")
    new = copy.deepcopy(old)
    new["spec"]["model"]["path"] = "/models/other"
    assert "spec.parallelism" in denied(webhook, new, old)


@pytest.mark.parametrize(
    ("name", "why"),
    [("l" * 53, "at most 52 are allowed"), ("7b-llama", "DNS-1035"), ("my.cache", "DNS-1035")],
)
def test_item3_names_whose_service_name_is_invalid_are_denied(
    webhook: LocalWebhook, name: str, why: str
) -> None:
    msg = denied(webhook, cache_obj(name=name))
    assert "metadata.name" in msg and why in msg
    assert verdict(webhook, cache_obj(name="l" * 52))["allowed"] is True
