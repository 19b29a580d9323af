"""Golden command lines of `vllm preload` for the seed document's layouts.

Each expectation is written out flag by flag from vLLM 0.33's launcher rules
(entrypoints/cli/preload.py, weight_cache/daemon.py), so a change in the builder shows up
as a readable diff.
"""

from __future__ import annotations

import pytest

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent import vllm_probe
from weightcache.agent.config import AgentEnv, ConfigError, build_config, parse_plan
from weightcache.agent.runtimes import get_runtime
from weightcache.agent.runtimes.vllm import draft_is_cached

SOCK = "/var/run/weightcache/default/llama"
TAIL = ["--weight-cache-socket-dir", SOCK, "--weight-cache-health-host", "127.0.0.1",
        "--weight-cache-health-port", "8478"]
MASTER = "llama-rendezvous.default.svc"


def runtime_for(plan: dict, node_rank: int = 0, gpus: int | None = None):
    parsed = parse_plan(__import__("json").dumps(plan))
    node = next(n["node"] for n in plan["nodes"] if n["rank"] == node_rank)
    env = AgentEnv(cache="llama", namespace="default", node=node, pod_ip="10.1.2.3",
                   pod_name="llama-agent-x", plan_path="/etc/weightcache/plan.json")
    n = gpus if gpus is not None else plan["layout"]["worldSize"] // plan["nodeCount"]
    environ = {"NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(n, node_rank)), "PATH": ""}
    cfg = build_config(env, parsed, environ)
    rt = get_runtime(cfg)
    rt.binary = "vllm"
    return rt


def test_tp4_single_node():
    rt = runtime_for(make_plan(tensor=4, engine_args={"dtype": "bfloat16"}))
    assert rt.command() == [
        "vllm", "preload", "--model", "/models/llama", "--dtype", "bfloat16",
        "--tensor-parallel-size", "4", "--weight-cache-master-port", "29600", *TAIL,
    ]
    ranks = rt.ranks()
    assert [(r.role, r.global_rank, r.tp_rank, r.dp_rank) for r in ranks] == [
        ("target", i, i, 0) for i in range(4)
    ]
    assert rt.environment()["CUDA_VISIBLE_DEVICES"] == ",".join(gpu_uuids(4))
    assert ranks[2].socket_path == vllm_probe.socket_path(SOCK, gpu_uuids(4)[2])


@pytest.mark.parametrize("node_rank", [0, 1])
def test_tp16_two_nodes(node_rank):
    rt = runtime_for(make_plan(tensor=16, nodes=2), node_rank)
    assert rt.command() == [
        "vllm", "preload", "--model", "/models/llama", "--tensor-parallel-size", "16",
        "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", MASTER,
        "--weight-cache-master-port", "29600", *TAIL,
    ]
    # r * (tp // nnodes) + i
    assert [(r.global_rank, r.tp_rank) for r in rt.ranks()] == [
        (node_rank * 8 + i, node_rank * 8 + i) for i in range(8)
    ]


@pytest.mark.parametrize("node_rank", [0, 3])
def test_tp1_dp16_ep_four_nodes(node_rank):
    rt = runtime_for(make_plan(tensor=1, data=16, nodes=4, expert=True), node_rank)
    assert rt.command() == [
        "vllm", "preload", "--model", "/models/llama", "--tensor-parallel-size", "1",
        "--enable-expert-parallel", "--data-parallel-size", "16",
        "--data-parallel-size-local", "4", "--data-parallel-start-rank", str(4 * node_rank),
        "--data-parallel-address", MASTER, "--weight-cache-master-port", "29600", *TAIL,
    ]
    # local GPU i serves DP rank start + i // tp and TP rank i % tp
    assert [(r.global_rank, r.dp_rank, r.tp_rank) for r in rt.ranks()] == [
        (4 * node_rank + i, 4 * node_rank + i, 0) for i in range(4)
    ]


@pytest.mark.parametrize("node_rank", [0, 1, 2, 3])
def test_tp8_dp2_ep_four_nodes(node_rank):
    rt = runtime_for(make_plan(tensor=8, data=2, nodes=4, expert=True), node_rank)
    assert rt.command() == [
        "vllm", "preload", "--model", "/models/llama", "--tensor-parallel-size", "8",
        "--enable-expert-parallel", "--nnodes", "4", "--node-rank", str(node_rank),
        "--master-addr", MASTER, "--data-parallel-size", "2", "--data-parallel-address", MASTER,
        "--weight-cache-master-port", "29600", *TAIL,
    ]
    # each node serves a contiguous block of the 16 global ranks
    assert [(r.global_rank, r.dp_rank, r.tp_rank) for r in rt.ranks()] == [
        (4 * node_rank + i, (4 * node_rank + i) // 8, (4 * node_rank + i) % 8) for i in range(4)
    ]


def test_eagle_draft_group_tp16_two_nodes():
    spec_cfg = {"method": "eagle3", "model": "/models/eagle3-head", "num_speculative_tokens": 3}
    rt = runtime_for(make_plan(tensor=16, nodes=2, engine_args={"speculativeConfig": spec_cfg}), 1)
    assert rt.command() == [
        "vllm", "preload", "--model", "/models/llama", "--speculative-config",
        '{"method":"eagle3","model":"/models/eagle3-head","num_speculative_tokens":3}',
        "--tensor-parallel-size", "16", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", MASTER, "--weight-cache-master-port", "29600",
        "--weight-cache-draft-master-port", "29601", *TAIL,
    ]
    ranks = rt.ranks()
    assert len(ranks) == 16
    drafts = [r for r in ranks if r.role == "draft"]
    assert [r.global_rank for r in drafts] == list(range(8, 16))
    assert all(r.socket_path.endswith("_draft.sock") for r in drafts)
    assert drafts[0].socket_path == vllm_probe.socket_path(SOCK, gpu_uuids(8, 1)[0], draft=True)


def test_mtp_draft_dp_layout():
    spec_cfg = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
    rt = runtime_for(make_plan(tensor=1, data=16, nodes=4, expert=True,
                               engine_args={"speculativeConfig": spec_cfg}), 2)
    cmd = rt.command()
    assert cmd[cmd.index("--weight-cache-draft-master-port") + 1] == "29601"
    assert {r.role for r in rt.ranks()} == {"target", "draft"}


@pytest.mark.parametrize(("spec", "cached"), [
    (None, False), ({"method": "ngram", "num_speculative_tokens": 3}, False),
    ({"method": "mtp"}, True), ({"method": "qwen3_next_mtp"}, True), ({"method": "eagle"}, True),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, True), ({"model": "ngram"}, False),
])
def test_draft_detection(spec, cached):
    assert draft_is_cached(spec) is cached


@pytest.mark.parametrize(("config", "method", "cached"), [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "draft_model", False),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, None, False),
    # vLLM infers mtp from the draft checkpoint (SpeculativeConfig.hf_config_override)
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, None, True),
    ({"model_type": "deepseek_mtp"}, None, True),
    ({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}, None, True),
])
def test_draft_detection_reads_the_draft_checkpoint(tmp_path, config, method, cached):
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    spec = {"model": str(tmp_path), **({"method": method} if method else {})}
    assert draft_is_cached(spec) is cached


def test_mtp_without_method_and_unreadable_draft_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"set speculativeConfig\.method"):
        draft_is_cached({"model": str(tmp_path / "missing")})


def test_dense_replicas_fill_single_node():
    rt = runtime_for(make_plan(tensor=2, data=4))
    assert rt.command()[4:10] == [
        "--tensor-parallel-size", "2", "--data-parallel-size", "4",
        "--data-parallel-size-local", "4",
    ]
    assert [(r.dp_rank, r.tp_rank) for r in rt.ranks()] == [(i // 2, i % 2) for i in range(8)]


def test_passthrough_and_conflicts():
    ea = {"dtype": "float16", "quantization": "fp8", "revision": "abc", "maxModelLen": 4096,
          "extraArgs": ["--trust-remote-code", "--seed", "7"]}
    cmd = runtime_for(make_plan(tensor=1, engine_args=ea)).command()
    assert cmd[4:12] == ["--dtype", "float16", "--quantization", "fp8", "--revision", "abc",
                         "--max-model-len", "4096"]
    assert cmd[-3:] == ["--trust-remote-code", "--seed", "7"]
    for bad in (["--tensor-parallel-size=2"], ["--load-format", "ipc_cache"], ["--nnodes", "2"],
                ["--tensor_parallel_size", "2"], ["-dpb", "ray"],
                # the seed channel and vLLM's --config file (a token on argv is readable in
                # the host's /proc of a hostPID pod)
                ["--seed-token", "s3cr3t"], ["--seed_token=s3cr3t"], ["--config", "x.yaml"],
                ["--seed-listen-port", "1"], ["--seed-source-host", "h"]):
        rt = runtime_for(make_plan(tensor=1, engine_args={"extraArgs": bad}))
        with pytest.raises(ConfigError, match="derives from the cache spec"):
            rt.command()
