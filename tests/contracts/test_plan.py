"""The plan document: version 2 states the layout once, and version 1 documents still read."""

from __future__ import annotations

import json

import pytest

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts.layout import Layout
from weightcache.contracts.plan import PLAN_VERSION, Plan, PlanError
from weightcache.operator import resources

CACHE = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u"}}


def _written(parallelism: dict, gpus: int | None = None) -> dict:
    raw = {"runtime": "native", "model": {"path": "/models/m"}, "parallelism": parallelism}
    if gpus is not None:
        raw["gpusPerNode"] = gpus
    spec = WeightCacheSpec.from_spec(raw, "ml", "llama")
    nodes = [f"n{i}" for i in range(spec.parallelism.nodes)]
    return json.loads(resources.plan(CACHE, spec, nodes, 1).to_json())


def _version1(doc: dict, parallelism: dict, gpus: int) -> dict:
    """The same plan as an operator before version 2 wrote it."""
    old = json.loads(json.dumps(doc))
    del old["version"]
    old["spec"]["parallelism"] = parallelism
    old["spec"]["gpusPerNode"] = gpus
    return old


def test_version_2_carries_the_layout_once():
    doc = _written({"tensor": 2}, gpus=8)
    assert doc["version"] == PLAN_VERSION == 2
    assert "parallelism" not in doc["spec"] and "gpusPerNode" not in doc["spec"]
    assert doc["layout"] == {"tensor": 2, "data": 4, "dataLocal": 4, "expert": False,
                             "worldSize": 8}
    assert doc["gpusPerNode"] == 8


@pytest.mark.parametrize("form", ["version 2", "version 1"])
def test_both_forms_read_to_the_same_plan(form):
    par = {"tensor": 8, "data": 2, "nodes": 4, "pipeline": 1, "dataLocal": 1, "expert": False}
    doc = _written(par)
    if form == "version 1":
        doc = _version1(doc, par, 4)
    plan = Plan.from_doc(doc)
    assert plan.layout == Layout(tensor=8, data=2, nodes=4, data_local=1)
    # The typed spec states the launched layout, whichever form was read.
    assert plan.spec.layout() == plan.layout and plan.spec.gpus == 4
    assert plan.spec.model.path == "/models/m" and plan.spec.socket_dir.endswith("/ml/llama")
    assert [r.global_rank for r in plan.local_ranks(3)] == [12, 13, 14, 15]
    assert Plan.from_json(plan.to_json()) == plan


def test_version_1_copy_still_refuses_pipeline_parallelism():
    doc = _version1(_written({"tensor": 1}), {"tensor": 1, "pipeline": 2}, 1)
    with pytest.raises(PlanError, match="pipeline parallelism"):
        Plan.from_doc(doc)


def test_a_newer_version_is_refused_by_name():
    doc = _written({"tensor": 1})
    doc["version"] = PLAN_VERSION + 1
    with pytest.raises(PlanError, match="version 3 is newer"):
        Plan.from_doc(doc)


def test_the_seed_source_round_trips_is_checked_and_restarts_nothing():
    from weightcache.contracts.plan import SeedSource

    raw = {"runtime": "vllm", "image": "v:1", "model": {"path": "/models/m"},
           "parallelism": {"tensor": 16, "nodes": 2}, "warmup": {"seed": {"from": "old"}}}
    spec = WeightCacheSpec.from_spec(raw, "ml", "llama")
    bare = resources.plan(CACHE, spec, ["n0", "n1"], 1)
    peer = SeedSource(cache="old", port=29800, hosts={1: "10.0.0.2", 0: "10.0.0.1"})
    seeded = resources.plan(CACHE, spec, ["n0", "n1"], 1, seed_from=peer)
    doc = json.loads(seeded.to_json())
    assert doc["seedFrom"] == {"cache": "old", "port": 29800, "hosts": [
        {"rank": 0, "host": "10.0.0.1"}, {"rank": 1, "host": "10.0.0.2"}]}
    assert Plan.from_json(seeded.to_json()).seed_from == peer
    assert Plan.from_json(bare.to_json()).seed_from is None
    # Where the source's pods are never restarts this group's agents.
    assert resources.plan_hash(seeded) == resources.plan_hash(bare)
    for bad, words in (({**doc["seedFrom"], "port": 70000}, "seedFrom.port"),
                       ({**doc["seedFrom"], "hosts": [{"rank": 2, "host": "h"}]},
                        "not a node rank"),
                       ({**doc["seedFrom"], "hosts": [{"rank": 0, "host": ""}]},
                        r"hosts\[0\]\.host"),
                       ("old", "seedFrom must be an object")):
        with pytest.raises(PlanError, match=words):
            Plan.from_doc({**doc, "seedFrom": bad})
