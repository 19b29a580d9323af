"""Every layout the operator can plan, launched by the agent, read by vLLM's `vllm preload`.

For each (tensor, data, nodes, expert) layout and each node, the agent's real command line
(agent/runtimes/vllm.py) goes through vLLM's own parser, `create_engine_config`, the
daemon's parallelism check and `plan_local_ranks` (vllm/entrypoints/cli/preload.py,
weight_cache/daemon.py). The ranks, roles, ports and socket paths the agent then probes
must be exactly the ones vLLM's daemons serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.plans import gpu_uuids, make_plan
from tests.conformance.conftest import Vllm, runtime_for
from weightcache.testing.checkpoints import write_llama_checkpoint

SOCK = "/var/run/weightcache/default/llama"


# (tensor, data, nodes, expert): the layouts placement accepts, one node to four.
LAYOUTS = [
    (1, 1, 1, False), (4, 1, 1, False), (8, 1, 1, False), (2, 2, 1, False), (1, 8, 1, True),
    (2, 4, 1, True), (16, 1, 2, False), (8, 2, 2, False), (4, 4, 2, True), (1, 16, 4, True),
    (8, 2, 4, True), (2, 8, 4, True), (16, 2, 4, True),
]


def node_cases() -> list[tuple[int, int, int, bool, int]]:
    out = []
    for tp, dp, nodes, ep in LAYOUTS:
        for rank in sorted({0, nodes - 1}):
            out.append((tp, dp, nodes, ep, rank))
    return out


@pytest.mark.parametrize(("tp", "dp", "nodes", "ep", "rank"), node_cases())
def test_agent_ranks_equal_vllm_preload_plan(
    vllm: Vllm, models: dict[str, str], tp: int, dp: int, nodes: int, ep: bool, rank: int
) -> None:
    model = models["moe" if ep or dp > 1 else "dense"]
    plan = make_plan(tensor=tp, data=dp, nodes=nodes, expert=ep, model=model)
    rt = runtime_for(plan, rank)
    argv = rt.command()
    assert argv[:2] == ["vllm", "preload"]
    got = vllm.call("preload", argv=argv[1:])
    ranks = [r for r in rt.ranks() if r.role == "target"]
    assert [r.local_index for r in ranks] == [p[0] for p in got["placements"]]
    assert [r.global_rank for r in ranks] == got["global_ranks"]
    assert [(r.dp_rank, r.tp_rank) for r in ranks] == [(p[1], p[3]) for p in got["placements"]]
    assert got["draft_group"] is False and all(r.role == "target" for r in rt.ranks())
    assert got["master_port"] == plan["spec"]["ports"]["rendezvous"]
    assert got["socket_dir"] == SOCK
    assert got["health"] == ["127.0.0.1", plan["spec"]["ports"]["health"]]
    if nodes > 1:
        assert plan["masterAddr"] in (got["master_addr"], got["dp_address"])
    for r in ranks:
        assert r.socket_path == vllm.call(
            "socket_path", uuid=r.device.uuid, socket_dir=SOCK, is_draft=False, fips=False
        )["path"]


@pytest.mark.parametrize("fips", [False, True])
@pytest.mark.parametrize("draft", [False, True])
def test_socket_names_equal_vllm_get_socket_path(
    vllm: Vllm, monkeypatch: pytest.MonkeyPatch, fips: bool, draft: bool
) -> None:
    """On a FIPS host md5 is refused for security use; vLLM then names sockets by sha256."""
    import hashlib

    from weightcache.agent import vllm_probe

    if fips:
        real = hashlib.md5

        def md5(data: bytes = b"", *, usedforsecurity: bool = True):  # type: ignore[no-untyped-def]
            if usedforsecurity:
                raise ValueError("[digital envelope routines] unsupported")
            return real(data, usedforsecurity=False)

        monkeypatch.setattr(hashlib, "md5", md5)
    uuid = gpu_uuids(1)[0]
    theirs = vllm.call("socket_path", uuid=uuid, socket_dir=SOCK, is_draft=draft, fips=fips)
    assert vllm_probe.socket_path(SOCK, uuid, draft=draft) == theirs["path"]
    plain = vllm.call("socket_path", uuid=uuid, socket_dir=SOCK, is_draft=draft, fips=False)
    assert (theirs["path"] != plain["path"]) is fips  # the FIPS case really takes sha256


def test_eagle3_draft_group(vllm: Vllm, models: dict[str, str], tmp_path: Path) -> None:
    head = tmp_path / "eagle3-head"
    write_llama_checkpoint(head, files=1)
    spec_cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    plan = make_plan(tensor=2, model=models["dense"], engine_args={"speculativeConfig": spec_cfg})
    rt = runtime_for(plan, 0)
    got = vllm.call("preload", argv=rt.command()[1:])
    assert got["draft_group"] is True and rt.has_draft
    assert got["draft_master_port"] == plan["spec"]["ports"]["draftRendezvous"]
    drafts = [r for r in rt.ranks() if r.role == "draft"]
    assert [r.global_rank for r in drafts] == got["global_ranks"]


def _draft_cases() -> list[dict]:
    from weightcache.agent.runtimes import vllm as rt

    base = {"num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 1, "hidden_size": 64,
            "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hc_count": 1}
    cases = [{**base, "model_type": t, "architectures": ["SomeForCausalLM"]}
             for t in sorted(rt.MTP_BASE_MODEL_TYPES)]
    cases += [{**base, "model_type": "x", "architectures": [a]}
              for a in sorted(rt.MTP_BASE_ARCHITECTURES)]
    cases += [{**base, "model_type": t, "architectures": [a]} for t, a in (
        ("llama", "LlamaForCausalLM"), ("mixtral", "MixtralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"), ("deepseek_mtp", "DeepSeekMTPModel"))]
    return cases


@pytest.mark.parametrize("config", _draft_cases(), ids=lambda c: f"{c['model_type']}-"
                         f"{c['architectures'][0]}")
def test_mtp_draft_inference_equals_vllms(vllm: Vllm, tmp_path: Path, config: dict) -> None:
    """No method: vLLM infers mtp from the draft's config.json, and so must the agent."""
    from weightcache.agent.runtimes.vllm import draft_is_cached

    theirs = vllm.call("draft_is_mtp", config=config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert draft_is_cached({"model": str(tmp_path)}) is theirs["mtp"], theirs
