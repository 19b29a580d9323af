"""The typed WeightCache API: one parse, every default, the user's values kept."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weightcache.api import schema
from weightcache.api.v1alpha1 import WeightCacheSpec, with_defaults

BASE = {"runtime": "native", "model": {"path": "/models/m"}}


def parse(raw: dict) -> WeightCacheSpec:
    return WeightCacheSpec.from_spec(raw, "ns", "llama")


def test_derived_defaults_are_resolved_once():
    spec = parse({**BASE, "model": {"path": "/data/m", "mountPath": "/data"},
                  "parallelism": {"tensor": 2, "data": 4, "nodes": 2},
                  "ports": {"rendezvous": 31000}})
    assert spec.model.volume == {"hostPath": {"path": "/data", "type": "Directory"}}
    assert spec.parallelism.data_local == 2 and spec.gpus_per_node == 4
    assert spec.socket_dir == "/var/run/weightcache/ns/llama"
    assert spec.ports.draft_rendezvous == 31001 and spec.device == "cuda"
    assert spec.layout().ranks_per_node == 4


def test_user_values_are_kept_even_when_invalid():
    spec = parse({**BASE, "parallelism": {"tensor": "two"}, "engine": {"mode": "fast"}})
    assert spec.parallelism.tensor == "two" and spec.engine.mode == "fast"
    # A nested object written as something else keeps the raw value for validation.
    odd = parse({**BASE, "ports": "8080"})
    assert odd.malformed == {"ports": "8080"} and odd.to_dict()["ports"] == "8080"


def test_explicit_null_is_absent():
    assert parse({**BASE, "parallelism": {"tensor": None}}).parallelism.tensor == 1


def test_dtype_is_implied_not_stated():
    spec = parse(BASE)
    assert spec.engine_args.dtype is None and spec.engine_args.effective_dtype == "auto"
    assert spec.to_dict()["engineArgs"]["dtype"] == "auto"
    props = schema.spec_schema()["properties"]
    assert props["engineArgs"]["properties"]["dtype"]["default"] == "auto"


def test_runtime_dependent_defaults():
    vllm = parse({"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0",
                  "model": {"path": "/models/m"}, "updateStrategy": {"type": "InPlace"}})
    assert vllm.device is None and vllm.device_kind == "cuda" and vllm.update_type == "Recreate"
    cpu = parse({**BASE, "device": "cpu"})
    assert not cpu.needs_gpus and cpu.update_type == "InPlace"


def test_filler_replicas_are_the_launched_layout():
    spec = parse({**BASE, "parallelism": {"tensor": 2}, "gpusPerNode": 8})
    launched = spec.launched_layout()
    assert (launched.tensor, launched.data, launched.data_local) == (2, 4, 4)
    assert spec.with_layout(launched, 8).layout() == launched


ints = st.integers(min_value=-1, max_value=9)
values = st.one_of(ints, st.none(), st.text(max_size=3), st.booleans())
specs = st.fixed_dictionaries(
    {"runtime": st.sampled_from(["native", "vllm", "x"])},
    optional={
        "model": st.one_of(st.fixed_dictionaries({"path": st.text(max_size=5)}), values),
        "parallelism": st.one_of(
            st.dictionaries(st.sampled_from(["tensor", "data", "nodes", "dataLocal", "pipeline",
                                             "expert"]), values),
            values),
        "ports": st.dictionaries(st.sampled_from(["rendezvous", "health", "grpc"]), values),
        "gpusPerNode": values,
        "engineArgs": st.dictionaries(st.sampled_from(["dtype", "extraArgs"]), values),
    },
)


@given(specs)
def test_parsing_a_rendered_spec_changes_nothing(raw):
    once = with_defaults(raw, "ns", "llama")
    assert with_defaults(once, "ns", "llama") == once


def test_warmup_defaults_are_derived_once():
    from weightcache.api.v1alpha1 import WeightCacheSpec

    spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/m/x"}}, "ml", "c")
    assert spec.to_dict()["warmup"] == {"enabled": True, "startupPlan": True,
                                        "cacheDir": "/var/cache/weightcache/ml/c",
                                        "seed": {"enabled": True}}
    assert spec.ports.seed == 29700 and spec.warmup.seed.from_ is None
    kept = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/m/x"},
                                      "warmup": {"cacheDir": "/data/wc"}}, "ml", "c")
    assert kept.warmup.cache_dir == "/data/wc" and kept.warmup.enabled is True
