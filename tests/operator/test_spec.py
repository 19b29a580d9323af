"""Defaults (the typed API) and the semantic rules of a WeightCache spec (shared by operator and
webhook)."""

from __future__ import annotations

import pytest

from weightcache.api.v1alpha1 import WeightCacheSpec, with_defaults
from weightcache.operator.spec import Problem, validate

BASE = {"runtime": "native", "model": {"path": "/models/m"}}


def _fields(spec: dict) -> list[str]:
    return [p.field for p in validate(spec)]


def test_defaults_fill_everything_and_keep_user_values():
    spec = with_defaults({**BASE, "ports": {"rendezvous": 30000}}, "ns", "llama")
    assert spec["socketDir"] == "/var/run/weightcache/ns/llama"
    assert spec["ports"] == {
        "rendezvous": 30000,
        "draftRendezvous": 30001,
        "health": 8478,
        "metrics": 9478,
        "grpc": 9479,
        "seed": 29700,
    }
    assert spec["model"]["volume"] == {"hostPath": {"path": "/models", "type": "Directory"}}
    assert spec["engine"] == {
        "mode": "zero_copy",
        "fallback": True,
        "connectTimeoutSeconds": 5,
        "stateTimeoutSeconds": 300,
    }
    assert spec["runAs"] == {"uid": 1000, "gid": 1000}
    assert spec["device"] == "cuda" and spec["gpusPerNode"] == 1
    assert validate(spec) == []
    # The input is not modified.
    assert "socketDir" not in BASE


def test_problem_is_a_dataclass_with_field_and_message():
    (problem,) = validate({**BASE, "socketDir": "relative/dir"})
    assert isinstance(problem, Problem)
    assert problem.field == "spec.socketDir" and "absolute" in problem.message


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"runtime": "vllm"}, "spec.image", "vLLM image"),
        ({"runtime": "vllm", "image": "vllm/vllm-openai"}, "spec.image", "pin"),
        ({"runtime": "vllm", "image": "vllm/vllm-openai:latest"}, "spec.image", "pin"),
        ({"image": "Not An Image!"}, "spec.image", "REPOSITORY:TAG"),
        ({"ports": {"health": 9478}}, "spec.ports.metrics", "already used"),
        ({"ports": {"rendezvous": 9479}}, "spec.ports.grpc", "already used"),
        ({"socketDir": "/var/run/../etc"}, "spec.socketDir", "normal form"),
        ({"socketDir": "/etc/x"}, "spec.socketDir", "system path"),
        # Every native cache's daemon state lies there, and no engine may mount it.
        ({"socketDir": "/var/lib/weightcache/daemon-state/ml/x"}, "spec.socketDir",
         "overlaps /var/lib/weightcache/daemon-state, where the daemons keep their state"),
        ({"warmup": {"cacheDir": "/var/lib/weightcache"}}, "spec.warmup.cacheDir",
         "overlaps /var/lib/weightcache/daemon-state, where the daemons keep their state"),
        ({"model": {"path": "/var/lib/m", "mountPath": "/var/lib"}},
         "spec.model.mountPath", "overlaps /var/lib/weightcache/daemon-state"),
        (
            {"model": {"path": "/m", "volume": {"emptyDir": {}}}},
            "spec.model.volume.emptyDir",
            "cannot load",
        ),
        (
            {"model": {"path": "/m", "volume": {"configMap": {"name": "x"}}}},
            "spec.model.volume.configMap",
            "1 MiB",
        ),
        (
            {"model": {"path": "/m", "volume": {"hostPath": {"path": "rel"}}}},
            "spec.model.volume.hostPath.path",
            "absolute",
        ),
        (
            {"model": {"path": "/m", "volume": {"hostPath": {"path": "/a"}, "nfs": {}}}},
            "spec.model.volume",
            "exactly one",
        ),
        (
            {"model": {"path": "/m", "volume": {"persistentVolumeClaim": {}}}},
            "spec.model.volume.persistentVolumeClaim.claimName",
            "claim",
        ),
        ({"model": {"path": "/other/m"}}, "spec.model.path", "outside"),
        (
            {
                "model": {"path": "/m", "volume": {"gcePersistentDisk": {"pdName": "d"}}},
                "parallelism": {"tensor": 16, "nodes": 2},
            },
            "spec.model.volume.gcePersistentDisk",
            "one node",
        ),
        (
            {"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0", "shardRules": [".*=0"]},
            "spec.shardRules",
            "native only",
        ),
        ({"shardRules": ["no-dim"]}, "spec.shardRules[0]", "REGEX=DIM"),
        ({"engine": {"mode": "fast"}}, "spec.engine.mode", "zero_copy"),
        ({"engine": {"stateTimeoutSeconds": 0}}, "spec.engine.stateTimeoutSeconds", "positive"),
        ({"parallelism": {"tensor": 4, "pipeline": 2}}, "spec.parallelism.pipeline", "pipeline"),
        ({"parallelism": {"tensor": 16, "nodes": 3}}, "spec.parallelism.nodes", "divide"),
        (
            {"parallelism": {"tensor": 8, "data": 2, "nodes": 4, "dataLocal": 2}},
            "spec.parallelism.dataLocal",
            "set dataLocal to 1",
        ),
        ({"parallelism": {"tensor": 8}, "gpusPerNode": 4}, "spec.gpusPerNode", "cannot hold"),
        (
            {"parallelism": {"tensor": 1, "data": 4, "expert": True}, "gpusPerNode": 4},
            "spec.parallelism.expert",
            "runtime vllm",
        ),
    ],
)
def test_rule_names_field_and_fix(patch, field, words):
    spec = {**BASE, **patch}
    problems = {p.field: p.message for p in validate(spec)}
    assert field in problems, problems
    assert words in problems[field]


def test_only_native_agents_mount_the_daemon_state_dir_so_only_they_keep_the_model_apart():
    model = {"path": "/var/lib/m", "mountPath": "/var/lib"}
    vllm = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0", "model": model}
    assert validate(with_defaults(vllm, "ns", "c")) == []
    # Beside it is fine: the chart's examples keep models in /var/lib/weightcache/models.
    sibling = {"path": "/var/lib/weightcache/models/m", "mountPath": "/var/lib/weightcache/models"}
    assert validate(with_defaults({**BASE, "model": sibling}, "ns", "c")) == []
    assert validate(with_defaults({**BASE, "socketDir": "/var/lib/weightcache/sockets"},
                                  "ns", "c")) == []


def test_valid_layouts_from_the_seed():
    vllm = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0"}
    for par, gpus in [
        ({"tensor": 16, "nodes": 2}, 8),
        ({"tensor": 1, "data": 16, "expert": True, "nodes": 4}, 4),
        ({"tensor": 8, "data": 2, "nodes": 4}, 4),
    ]:
        runtime = vllm if par.get("expert") else {}
        spec = with_defaults({**BASE, **runtime, "parallelism": par}, "ns", "c")
        assert validate(spec) == []
        assert WeightCacheSpec.from_spec(spec, "ns", "c").gpus == gpus


def test_valid_vllm_images():
    for image in (
        "vllm/vllm-openai:v0.31.0",
        "registry.example.com:5000/team/vllm:0.31.0-cu128",
        "vllm/vllm-openai@sha256:" + "a" * 64,
    ):
        assert _fields({**BASE, "runtime": "vllm", "image": image}) == []


VLLM_TP2 = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.33.0", "model": {"path": "/models/m"},
            "parallelism": {"tensor": 2}}


def _seed(seed: dict, **extra) -> dict:
    return {**VLLM_TP2, **extra, "warmup": {**extra.pop("warmup", {}), "seed": seed}}


def test_a_seed_source_must_be_a_cache_of_the_same_namespace():
    assert validate(_seed({"from": "old"}), "new") == []
    for source, words in (("other-ns/old", "never crosses namespaces"),
                          ("Old_1", "not a valid WeightCache name"),
                          ("new", "cannot seed from itself")):
        problems = validate(_seed({"from": source}), "new")
        assert [p.field for p in problems] == ["spec.warmup.seed.from"], source
        assert words in problems[0].message


def test_seed_from_contradictions_name_the_field():
    cases = (
        (_seed({"from": "old", "enabled": False}), "seed.enabled is false"),
        ({**_seed({"from": "old"}), "warmup": {"enabled": False, "seed": {"from": "old"}}},
         "warmup.enabled: true"),
        ({**BASE, "warmup": {"seed": {"from": "old"}}}, "runtime vllm only"),
        (_seed({"enabled": "yes"}), "true or false"),
    )
    for spec, words in cases:
        problems = validate(spec, "new")
        assert len(problems) == 1 and problems[0].field.startswith("spec.warmup.seed"), problems
        assert words in problems[0].message, problems


def test_the_seed_port_block_must_fit_and_miss_the_other_ports():
    # TP 8: ports 29596..29603 hold the rendezvous ports 29600 and 29601.
    tp8 = {**VLLM_TP2, "parallelism": {"tensor": 8}}
    problems = validate({**tp8, "ports": {"seed": 29596}}, "c")
    assert [p.field for p in problems] == ["spec.ports.seed"] * 2
    assert "29596-29603" in problems[0].message and "rendezvous 29600" in problems[0].message
    assert [p.field for p in validate({**tp8, "ports": {"seed": 65530}}, "c")] == [
        "spec.ports.seed"]
    # A draft group doubles the block (vLLM puts it after the target's).
    spec = {**tp8, "engineArgs": {"speculativeConfig": {"method": "mtp"}},
            "ports": {"seed": 29592}}
    assert [p.field for p in validate(spec, "c")] == ["spec.ports.seed"] * 2
    assert validate({**tp8, "ports": {"seed": 29592}}, "c") == []
    # Seeding off, or world size 1 (vLLM 0.33 does not seed it): the block is not used.
    assert validate({**tp8, "ports": {"seed": 65530},
                     "warmup": {"seed": {"enabled": False}}}, "c") == []
    assert validate({**VLLM_TP2, "parallelism": {"tensor": 1}, "ports": {"seed": 65535}},
                    "c") == []
