"""One vLLM driver process per supported version (tests/conformance/versions.txt).

`make test` installs each version with `make vllm-conformance` into `.venv/vllm/<version>/`
(its wheel with --no-deps plus requirements-vllm-cpu.txt: no CUDA stack) and sets
WEIGHTCACHE_REQUIRE_VLLM=1, so a missing install fails there instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
VERSIONS = [v.strip() for v in (HERE / "versions.txt").read_text().split() if v.strip()]
INSTALL = Path(os.environ.get("WEIGHTCACHE_VLLM_DIR", ROOT / ".venv" / "vllm"))
STARTUP_S = 240


class Vllm:
    """Requests to the driver: each returns vLLM's result or raises VllmRefused."""

    def __init__(self, version: str, proc: subprocess.Popen[str]) -> None:
        self.version = version
        self.proc = proc

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM {self.version} driver exited")
        reply = json.loads(line)
        if not reply["ok"]:
            raise VllmRefused(reply["error"])
        return reply["result"]


class VllmRefused(Exception):
    """vLLM's own code raised: the message is vLLM's."""


@pytest.fixture(scope="session", params=VERSIONS, ids=[f"vllm-{v}" for v in VERSIONS])
def vllm(request: pytest.FixtureRequest) -> Iterator[Vllm]:
    version = request.param
    target = INSTALL / version
    if not (target / "vllm" / "__init__.py").exists():
        why = f"vLLM {version} is not installed in {target} (make vllm-conformance)"
        if os.environ.get("WEIGHTCACHE_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(target), "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "driver.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=env, cwd="/",
    )
    assert proc.stdout is not None
    hello = json.loads(proc.stdout.readline() or '{"ready": false}')
    if not hello.get("ready"):
        proc.kill()
        pytest.fail(f"the vLLM {version} driver did not start")
    assert hello["version"] == version
    try:
        yield Vllm(version, proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# config.json only: vLLM's config and rank planning read nothing else (the fingerprint then
# names the checkpoint by its path). 32 heads and 32 experts divide every layout's TP and EP.
SHAPE = {
    "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 32,
    "num_key_value_heads": 32, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 16384, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
DENSE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE}
MOE_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **SHAPE,
    "num_local_experts": 32, "num_experts_per_tok": 2,
}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, config in (("dense", DENSE_CONFIG), ("moe", MOE_CONFIG)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = str(root / name)
    return out


def runtime_for(plan: dict, node_rank: int = 0, pod_ip: str = "10.1.2.3") -> Any:
    """The agent's real vllm runtime for one node of a plan (GPUs named by gpu_uuids)."""
    from tests.agent.plans import gpu_uuids
    from weightcache.agent.config import AgentEnv, build_config, parse_plan
    from weightcache.agent.runtimes import get_runtime

    parsed = parse_plan(json.dumps(plan))
    node = next(n["node"] for n in plan["nodes"] if n["rank"] == node_rank)
    env = AgentEnv(cache=plan["cache"], namespace=plan["namespace"], node=node,
                   pod_ip=pod_ip, pod_name=f"{plan['cache']}-agent-x",
                   plan_path="/etc/weightcache/plan.json")
    n = plan["layout"]["worldSize"] // plan["nodeCount"]
    environ = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(n, node_rank)), "PATH": ""}
    rt = get_runtime(build_config(env, parsed, environ))
    rt.binary = "vllm"
    return rt
