"""The warmup directory: the agent's `vllm preload` and the webhook's engine see one directory.

A real agent process supervises the stand-in `vllm preload` (which records its environment and
writes an autotune table the way vLLM does: only when it had to tune); the engine side is the
webhook's own `inject()` on a pod of the same cache. The plan is the operator's own
(`resources.plan`), so the three components are the real ones.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from pathlib import Path
from typing import Any

from tests.agent.plans import gpu_uuids
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator import resources
from weightcache.operator.admission.inject import apply_ops, inject

VARS = ("VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR")


def cache_obj(warm: Path, **spec: Any) -> dict[str, Any]:
    body = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.33.0",
            "model": {"path": "/models/llama", "mountPath": "/models"},
            "parallelism": {"tensor": 2}, "warmup": {"cacheDir": str(warm)}, **spec}
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache",
            "metadata": {"name": "llama", "namespace": "default", "uid": "uid-llama"},
            "spec": body, "status": {"phase": "Ready"}}


def plan_of(cache: dict[str, Any]) -> dict[str, Any]:
    spec = WeightCacheSpec.from_object(cache)
    return json.loads(resources.plan(cache, spec, ["gpu-a"], epoch=1).to_json())


def engine_env(cache: dict[str, Any]) -> dict[str, str]:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "e", "namespace": "default",
                        "annotations": {"weightcache.io/cache": "llama"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                                    "command": ["vllm", "serve", "/models/llama", "-tp", "2"]}]}}
    res = inject(pod, cache)
    injected = apply_ops(pod, res.ops)
    return {e["name"]: e.get("value") for e in injected["spec"]["containers"][0]["env"]}


def start(agents: Any, cache: dict[str, Any], vllm_bin: str, env_out: Path) -> Any:
    return agents(plan_of(cache), env={
        "WEIGHTCACHE_VLLM_BIN": vllm_bin, "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(2)),
        "FAKE_VLLM_ENV_OUT": str(env_out), "FAKE_VLLM_AUTOTUNE": "1"}).start()


def metric_lines(agent: Any, name: str) -> list[str]:
    url = f"http://{agent.metrics_target}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    return [line for line in body.splitlines() if line.startswith(name)]


def test_daemon_and_engine_share_one_private_directory_and_restarts_reuse_it(
        agents, vllm_bin, tmp_path):
    warm = tmp_path / "warm"
    cache = cache_obj(warm)
    stale = warm / ("0" * 16)  # an earlier model's identity: pruned once the group is Ready
    foreign = warm / "keep-me"  # not an identity name: never touched
    stale.mkdir(parents=True)
    foreign.mkdir()
    (stale / "kernel.so").write_bytes(b"x")
    env_out = tmp_path / "env1.json"
    agent = start(agents, cache, vllm_bin, env_out)
    st = agent.wait_ready(timeout=60)

    daemon = json.loads(env_out.read_text())
    engine = engine_env(cache)
    # The same three roots for `vllm preload` and the engine, under <cacheDir>/<identity>.
    root = Path(daemon["VLLM_CACHE_ROOT"]).parent
    assert root.parent == warm and len(root.name) == 16
    assert {k: daemon[k] for k in VARS} == {k: engine[k] for k in VARS}
    assert engine["VLLM_ENABLE_STARTUP_PLAN"] == "1"
    assert "VLLM_ENABLE_STARTUP_PLAN" not in daemon  # the daemon never profiles KV memory
    for path in (warm, root, Path(daemon["VLLM_CACHE_ROOT"])):
        mode = os.lstat(path).st_mode
        assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700, path
    # Status: the directory, its size by kind, the first start tuned (a miss).
    wc = st.warmup_cache
    assert wc.path == str(root) and wc.identity == root.name and not wc.unsafe
    agent.wait(lambda s: s.warmup_cache.misses.get("flashinfer_autotune") == 1)
    st = agent.wait(lambda s: s.warmup_cache.bytes_by_kind.get("vllm", 0) > 0)
    assert st.warmup_cache.bytes == sum(st.warmup_cache.bytes_by_kind.values())
    assert not stale.exists() and foreign.exists()
    gauge = metric_lines(agent, "weightcache_warmup_cache_bytes")
    assert any('kind="vllm"' in line and not line.endswith(" 0.0") for line in gauge)
    assert agent.terminate() == 0

    # A restart on the same node finds the table: a hit, nothing rewritten.
    agent2 = start(agents, cache, vllm_bin, tmp_path / "env2.json")
    agent2.wait_ready(timeout=60)
    st2 = agent2.wait(lambda s: s.warmup_cache.hits.get("flashinfer_autotune") == 1)
    assert st2.warmup_cache.misses.get("flashinfer_autotune", 0) == 0
    hits = metric_lines(agent2, "weightcache_warmup_cache_hits_total")
    assert any('kind="flashinfer_autotune"' in line and line.endswith(" 1.0") for line in hits)


def test_a_new_model_gets_a_fresh_identity(tmp_path):
    warm = tmp_path / "warm"
    old = engine_env(cache_obj(warm))["VLLM_CACHE_ROOT"]
    new = engine_env(cache_obj(warm, model={"path": "/models/llama-2", "mountPath": "/models"}))
    args = engine_env(cache_obj(warm, engineArgs={"maxModelLen": 4096}))
    image = engine_env(cache_obj(warm, image="vllm/vllm-openai:v0.34.0"))
    roots = {old, new["VLLM_CACHE_ROOT"], args["VLLM_CACHE_ROOT"], image["VLLM_CACHE_ROOT"]}
    assert len(roots) == 4


def test_a_symlinked_directory_is_refused_and_the_daemons_run_without_it(
        agents, vllm_bin, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    warm = tmp_path / "warm"
    warm.symlink_to(target)
    env_out = tmp_path / "env.json"
    agent = start(agents, cache_obj(warm), vllm_bin, env_out)
    st = agent.wait_ready(timeout=60)
    assert "symlink" in st.warmup_cache.unsafe and not st.warmup_cache.path
    daemon = json.loads(env_out.read_text())
    assert not any(k in daemon for k in VARS)
    assert list(target.iterdir()) == []
