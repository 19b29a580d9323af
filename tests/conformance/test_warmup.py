"""The warmup caches with vLLM's real code: the daemon writes where the injected engine reads.

The agent's side is its real vllm runtime (argv and environment of `vllm preload`, the
directory prepared by `agent/warmup.py`) for a plan the operator builds; the engine's side is
the webhook's `inject()` on a pod of the same cache. Each process is one fresh interpreter
(tests/conformance/warmup_probe.py) with exactly that environment, calling vLLM's and
FlashInfer's own path and key functions. What needs a GPU (the tuning, the compile-cache
hit, applying a startup plan) is not run here: tests/gpu and docs/warmup.md say how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.conftest import HERE, INSTALL, runtime_for
from weightcache.agent import warmup as agent_warmup
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator import resources
from weightcache.operator.admission.inject import apply_ops, inject

PROBE = HERE / "warmup_probe.py"


def probe(version: str, argv: list[str], env: dict[str, str], ranks: list[int]) -> dict:
    return probe_many(version, [argv], env, ranks)[0]


def probe_many(version: str, argvs: list[list[str]], env: dict[str, str],
               ranks: list[int]) -> list[dict]:
    """One fresh process with `env`, viewing each command line in turn."""
    base = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(INSTALL / version),
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            # FlashInfer names its arch directory from the GPUs; on CPU from this list (H200).
            "FLASHINFER_CUDA_ARCH_LIST": "9.0"}
    full = {**base, **{k: v for k, v in env.items() if k != "PYTHONPATH"}}
    requests = [{"argv": argv, "ranks": ranks} for argv in argvs]
    out = subprocess.run([sys.executable, str(PROBE), json.dumps(requests)],
                         env=full, capture_output=True, text=True, timeout=300, cwd="/")
    lines = [line for line in out.stdout.splitlines() if line.startswith("OUT ")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1][4:])


def cache_obj(model: str, warm: Path, tensor: int) -> dict[str, Any]:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1"},
            "spec": {"runtime": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                     "model": {"path": model, "mountPath": str(Path(model).parent)},
                     "parallelism": {"tensor": tensor}, "warmup": {"cacheDir": str(warm)}},
            "status": {"phase": "Ready"}}


def daemon_side(cache: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """`vllm preload`'s argv and the environment the agent adds (its pod has HOME=/tmp)."""
    spec = WeightCacheSpec.from_object(cache)
    plan = json.loads(resources.plan(cache, spec, ["gpu-a"], epoch=1).to_json())
    rt = runtime_for(plan)
    state = agent_warmup.prepare(rt.cfg)
    assert state.path and not state.unsafe
    rt.warmup_root = state.path
    env = {k: v for k, v in rt.environment().items() if v is not None}
    return rt.command()[1:], {"HOME": "/tmp", **env}


def engine_side(cache: dict[str, Any], *extra: str) -> tuple[list[str], dict[str, str], Any]:
    model, tensor = cache["spec"]["model"]["path"], cache["spec"]["parallelism"]["tensor"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "e", "namespace": "ml",
                        "annotations": {"weightcache.io/cache": "llama"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                                    "command": ["vllm", "serve", model, "-tp", str(tensor),
                                                *extra]}]}}
    res = inject(pod, cache)
    c = apply_ops(pod, res.ops)["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e}
    return [*c["command"][1:], *c.get("args", [])], {"HOME": "/home/engine", **env}, res


@pytest.fixture(scope="module")
def tp2(vllm, models, tmp_path_factory) -> dict[str, Any]:
    """A TP-2 cache: the daemon's view (one `vllm preload` process) and its inputs."""
    cache = cache_obj(models["dense"], tmp_path_factory.mktemp("warm"), 2)
    d_argv, d_env = daemon_side(cache)
    return {"cache": cache, "env": d_env, "view": probe(vllm.version, d_argv, d_env, [0, 1])}


def test_the_engine_resolves_the_daemons_table_compile_key_and_plan(vllm, tp2):
    e_argv, e_env, res = engine_side(tp2["cache"])
    assert not [w for w in res.warnings if "config hash" in w or "compile-cache" in w]
    daemon = tp2["view"]
    engine = probe(vllm.version, e_argv, e_env, [0, 1])
    root = Path(tp2["env"]["VLLM_CACHE_ROOT"])
    assert root.parent.parent == Path(tp2["cache"]["spec"]["warmup"]["cacheDir"])
    # The per-rank FlashInfer tables (v1: world size > 1), one per rank, and FlashInfer's v2
    # store (world size 1 uses it; its root depends on the environment only).
    assert daemon["tables"] == engine["tables"] and len(set(daemon["tables"])) == 2
    assert all(Path(t).is_relative_to(root / "flashinfer_autotune_cache")
               for t in daemon["tables"])
    assert daemon["v2_root"] == engine["v2_root"]
    assert Path(daemon["v2_root"]).is_relative_to(root.parent / "flashinfer")
    # torch.compile: the same key factors, so the same directory under the shared root.
    for key in ("table_hash", "config_hash", "env_hash", "aot_hash", "cache_root"):
        assert daemon[key] == engine[key], key
    # The startup plan: only the engine persists one, under the shared root.
    assert engine["plan_enabled"] and not daemon["plan_enabled"]
    assert Path(engine["plan"]).is_relative_to(root)
    # A second engine start (a new process) resolves the same directories and keys.
    again = probe(vllm.version, e_argv, e_env, [0, 1])
    keys = ("tables", "v2_root", "aot_hash", "env_hash", "plan")
    assert {k: again[k] for k in keys} == {k: engine[k] for k in keys}
    assert again["pid"] != engine["pid"]


def test_the_webhook_warns_exactly_for_flags_that_change_vllms_key(vllm, tp2):
    cases = ((["--max-num-seqs", "64"], True), (["--block-size", "32"], True),
             (["--enforce-eager"], True), (["--max-num-batched-tokens", "1024"], True),
             (["--gpu-memory-utilization", "0.8"], False), (["--enable-prefix-caching"], False),
             (["--served-model-name", "x", "--port", "9000"], False))
    sides = [engine_side(tp2["cache"], *extra) for extra, _ in cases]
    # No extra flag: the same environment for every case, so one engine process views all.
    assert len({json.dumps(env, sort_keys=True) for _, env, _ in sides}) == 1
    views = probe_many(vllm.version, [argv for argv, _, _ in sides], sides[0][1], [0])
    for (extra, changes), (_, _, res), engine in zip(cases, sides, views, strict=True):
        warned = any("config hash" in w for w in res.warnings)
        assert (engine["table_hash"] != tp2["view"]["table_hash"]) is changes, extra
        assert warned is changes, (extra, res.warnings)
    # The control: without the shared directory's variables (an engine before issue 23,
    # its own HOME), the key is the same but the tables lie elsewhere.
    plain = probe(vllm.version, sides[-1][0], {"HOME": "/home/engine"}, [0, 1])
    assert plain["config_hash"] == tp2["view"]["config_hash"]
    assert plain["tables"] != tp2["view"]["tables"]
