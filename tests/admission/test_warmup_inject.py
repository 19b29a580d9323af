"""The webhook's warmup-directory injection (pure `inject()`; the paths' agreement with the
agent and with vLLM is in tests/agent/test_warmup_dir.py and tests/conformance/test_warmup.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.admission.conftest import cache_obj
from weightcache.operator.admission.inject import Denied, apply_ops, inject
from weightcache.operator.spec import validate


def engine_pod(name: str, env: list[dict] | None = None, **container: Any) -> dict:
    c = {"name": "vllm", "image": "vllm/vllm-openai:v0.31.0",
         "command": ["vllm", "serve", "/models/llama-3.1-8b"], **container}
    if env is not None:
        c["env"] = env
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "e", "namespace": "serving",
                         "annotations": {"weightcache.io/cache": name}},
            "spec": {"containers": [c]}}


def test_a_users_own_cache_root_is_kept_and_reported_and_vllm_vars_warned() -> None:
    cache = cache_obj()
    name = cache["metadata"]["name"]
    pod = engine_pod(name, env=[{"name": "VLLM_CACHE_ROOT", "value": "/root/.cache/vllm"},
                                {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"},
                                {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])
    res = inject(pod, cache)
    env = {e["name"]: e.get("value") for e in apply_ops(pod, res.ops)["spec"]["containers"][0]
           ["env"]}
    assert env["VLLM_CACHE_ROOT"] == "/root/.cache/vllm"  # kept
    assert env["FLASHINFER_WORKSPACE_BASE"].startswith(f"/var/cache/weightcache/serving/{name}/")
    assert any("sets VLLM_CACHE_ROOT itself" in m for m in res.mismatches)
    warned = [w for w in res.warnings if "compile-cache key" in w]
    assert len(warned) == 1 and "VLLM_USE_V2_MODEL_RUNNER" in warned[0]  # not the logging var
    # Admitting the injected pod again changes nothing.
    again = inject(apply_ops(pod, res.ops), cache)
    assert again.ops == []


def test_disabled_warmup_injects_nothing_and_startup_plan_is_a_switch() -> None:
    cache = cache_obj(warmup={"enabled": False})
    pod = engine_pod(cache["metadata"]["name"])
    patched = apply_ops(pod, inject(pod, cache).ops)
    c = patched["spec"]["containers"][0]
    assert not [e for e in c.get("env") or [] if e["name"].startswith(("VLLM_", "FLASHINFER"))]
    assert "weightcache-warmup" not in {v["name"] for v in patched["spec"]["volumes"]}
    cache = cache_obj(warmup={"startupPlan": False})
    pod = engine_pod(cache["metadata"]["name"])
    env = {e["name"] for e in apply_ops(pod, inject(pod, cache).ops)["spec"]["containers"][0]
           ["env"]}
    assert "VLLM_CACHE_ROOT" in env and "VLLM_ENABLE_STARTUP_PLAN" not in env


def test_a_foreign_volume_at_the_warmup_path_is_denied() -> None:
    cache = cache_obj()
    name = cache["metadata"]["name"]
    pod = engine_pod(name, volumeMounts=[{"name": "mine",
                                          "mountPath": f"/var/cache/weightcache/serving/{name}"}])
    pod["spec"]["volumes"] = [{"name": "mine", "emptyDir": {}}]
    with pytest.raises(Denied, match="warmup directory must appear"):
        inject(pod, cache)


def test_key_flag_differences_are_warned() -> None:
    cache = cache_obj(engineArgs={"maxModelLen": 8192, "extraArgs": ["--max-num-seqs", "64"]})
    pod = engine_pod(cache["metadata"]["name"],
                     args=["--max-num-seqs", "64", "--max-model-len", "4096", "-O0"])
    warned = [w for w in inject(pod, cache).warnings if "config hash" in w]
    assert len(warned) == 2
    assert any("--max-model-len 4096" in w and "8192" in w for w in warned)
    assert any("--optimization-level 0" in w for w in warned)


@pytest.mark.parametrize(("cache_dir", "fragment"), [
    ("relative/dir", "absolute host path"),
    ("/var/cache/../etc", "normal form"),
    ("/etc/weightcache", "system path"),
    ("/var/run/weightcache/default/cache/x", "overlaps spec.socketDir"),
    ("/models/cache", "overlaps spec.model.mountPath"),
])
def test_bad_cache_dirs_are_refused(cache_dir: str, fragment: str) -> None:
    problems = validate({"runtime": "native", "model": {"path": "/models/m"},
                         "warmup": {"cacheDir": cache_dir}})
    assert [p.field for p in problems] == ["spec.warmup.cacheDir"]
    assert fragment in problems[0].message
