"""Fingerprint fields, loader keys and run-as rules the webhook checks (pure decisions).

The rules come from vLLM 0.33's code: `WeightCacheKey` fields and `from_model_config`
(weight_cache/protocol.py), the dtype names of `ModelConfig` (config/model.py
`_STR_DTYPE_TO_TORCH_DTYPE`), the keys `IpcModelLoader.__init__` accepts
(weight_cache/ipc_loader.py); tests/conformance checks the same decisions against that code.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.admission import pods
from tests.admission.conftest import cache_obj
from weightcache.operator.admission import inject, loaderconfig


def decide(pod: dict, **spec: Any) -> inject.Result:
    cache = cache_obj(**spec)
    pod["metadata"]["annotations"]["weightcache.io/cache"] = cache["metadata"]["name"]
    return inject.inject(pod, cache)


def fields(res: inject.Result) -> dict[str, tuple[str, str]]:
    return {d.field: (d.engine, d.cache) for d in res.differences}


@pytest.mark.parametrize(
    ("flags", "cache_dtype"),
    [
        (["--dtype", "half"], "float16"),
        (["--dtype=float16"], "float16"),
        (["--dtype", "float"], "float32"),
        ([], "auto"),
        (["--dtype", "auto"], "auto"),
    ],
)
def test_dtype_spellings_vllm_resolves_alike_do_not_warn(flags: list, cache_dtype: str) -> None:
    res = decide(pods.serve_args_pod("x", *flags), engineArgs={"dtype": cache_dtype})
    assert "dtype" not in fields(res)
    assert not any("dtype" in w for w in res.warnings)


def test_auto_against_explicit_dtype_says_it_could_not_check() -> None:
    res = decide(pods.serve_args_pod("x"), engineArgs={"dtype": "bfloat16"})
    assert "dtype" not in fields(res) and res.mismatches == []
    assert any(w.startswith("could not check the dtype") for w in res.warnings)


def test_explicit_dtypes_that_differ_are_a_difference() -> None:
    res = decide(pods.serve_args_pod("x", "--dtype", "half"), engineArgs={"dtype": "bfloat16"})
    assert fields(res)["dtype"] == ("float16", "bfloat16")
    assert any("fingerprint field dtype: container 'vllm' has float16" in m for m in res.mismatches)


@pytest.mark.parametrize(
    ("flags", "spec", "field", "values"),
    [
        ([], {"engineArgs": {"revision": "main"}}, "revision", ("None", "main")),
        (["--revision", "v2"], {"engineArgs": {"revision": "v1"}}, "revision", ("v2", "v1")),
        (["-q", "fp8"], {}, "quantization", ("fp8", "None")),
        ([], {"engineArgs": {"quantization": "fp8"}}, "quantization", ("None", "fp8")),
        (
            ["--kv-cache-dtype", "fp8"], {}, "kv_cache_dtype", ("fp8", "auto"),
        ),
        (
            [], {"engineArgs": {"extraArgs": ["--kv-cache-dtype", "fp8"]}}, "kv_cache_dtype",
            ("auto", "fp8"),
        ),
        ([], {"parallelism": {"expert": True}}, "enable_expert_parallel", ("False", "True")),
        (
            ["--enable-expert-parallel", "--no-enable-expert-parallel"],
            {"parallelism": {"expert": True}}, "enable_expert_parallel", ("False", "True"),
        ),
        (["-ep"], {}, "enable_expert_parallel", ("True", "False")),
        (
            ["--moe-backend", "triton"], {}, "moe_backend", ("triton", "auto"),
        ),
    ],
)
def test_each_fingerprint_field_is_compared(
    flags: list, spec: dict, field: str, values: tuple
) -> None:
    res = decide(pods.serve_args_pod("x", *flags), **spec)
    assert fields(res) == {field: values}
    (message,) = res.mismatches
    assert message.startswith(f"fingerprint field {field}: container 'vllm' has {values[0]}")
    assert f"the cache holds {values[1]}" in message


@pytest.mark.parametrize(
    ("flags", "spec"),
    [
        (["--revision", "main", "-q", "fp8"], {"engineArgs": {"revision": "main",
                                                            "quantization": "fp8"}}),
        (["-ep", "--kv-cache-dtype", "fp8"], {
            "parallelism": {"expert": True},
            "engineArgs": {"extraArgs": ["--kv-cache-dtype", "fp8"]},
        }),
    ],
)
def test_matching_fields_are_quiet(flags: list, spec: dict) -> None:
    res = decide(pods.serve_args_pod("x", *flags), **spec)
    assert res.differences == [] and res.mismatches == []


def user_config(config: dict) -> dict:
    return pods.serve_args_pod("x", "--model-loader-extra-config", json.dumps(config))


def test_unknown_loader_key_is_denied_with_the_accepted_keys() -> None:
    with pytest.raises(inject.Denied) as err:
        decide(user_config({"socket_dir": "/var/run/weightcache/serving/x", "timeout": 5}))
    text = str(err.value)
    assert "keys timeout are not accepted by vLLM's ipc_cache loader" in text
    assert "accepted keys: connect_timeout_s, fallback, mode, socket_dir, socket_path" in text


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"mode": "fast"}, "mode 'fast' is not one of zero_copy, copy"),
        ({"connect_timeout_s": "soon"}, "connect_timeout_s 'soon' is not a number"),
        ({"state_timeout_s": None}, "state_timeout_s None is not a number"),
        ({"is_draft": True}, "keys is_draft are not accepted"),
    ],
)
def test_values_the_loader_refuses_are_denied(config: dict, why: str) -> None:
    with pytest.raises(inject.Denied, match="refuses at start"):
        decide(user_config(config))
    assert any(why in p for p in loaderconfig.problems(config))


def test_every_accepted_key_is_admitted() -> None:
    config = {
        "socket_dir": "/var/run/weightcache/serving/x", "mode": "copy", "fallback": False,
        "connect_timeout_s": 2, "state_timeout_s": "30",
    }
    cache = cache_obj(name="x")
    res = inject.inject(user_config(config), cache)
    assert res.ops and not res.mismatches


@pytest.mark.parametrize("level", ["pod", "container"])
def test_root_cache_into_non_root_pod_is_denied(level: str) -> None:
    pod = pods.serve_args_pod("x")
    holder = pod["spec"] if level == "pod" else pod["spec"]["containers"][0]
    holder["securityContext"] = {"runAsNonRoot": True}
    with pytest.raises(inject.Denied, match="runAsNonRoot: true") as err:
        decide(pod, runAs={"uid": 0, "gid": 0})
    assert "kubelet would refuse to start it" in str(err.value)


def test_non_root_cache_into_non_root_pod_is_admitted() -> None:
    pod = pods.serve_args_pod("x")
    pod["spec"]["securityContext"] = {"runAsNonRoot": True}
    res = decide(pod, runAs={"uid": 1000, "gid": 1000})
    assert res.ops
