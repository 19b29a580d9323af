"""The agent's Update RPC on the native runtime (CPU): real agent, launcher, daemons, engines.

The operator drives in-place updates through this RPC; what it relies on is asserted here:
one call (or PREPARE/PAUSE/COMMIT) switches every local rank, a refusal leaves the old
generation serving and names why, Status and /metrics report the generation, and a daemon
restart after an update loads the revision the engines were switched to.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.agent.plans import make_plan
from weightcache.contracts.proto import agent_pb2
from weightcache.native.engine.attach import attach
from weightcache.testing.checkpoints import TINY, LlamaShape, write_llama_checkpoint

from .test_native_e2e import hello


@pytest.fixture(scope="module")
def revision2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Same layout as the session checkpoint, other bytes.
    return write_llama_checkpoint(tmp_path_factory.mktemp("rev2") / "tiny", TINY, files=2, seed=3)


def update(agent, phase=agent_pb2.UPDATE_PHASE_ALL, **fields) -> agent_pb2.UpdateResponse:
    return agent.stub().Update(agent_pb2.UpdateRequest(phase=phase, **fields), timeout=120)


def test_update_rpc_switches_refuses_and_survives_restart(agents, checkpoint, revision2,
                                                          tmp_path):
    agent = agents(make_plan(runtime="native", tensor=2, model=str(checkpoint),
                             spec_extra={"device": "cpu"})).start()
    st = agent.wait_ready(timeout=90)
    assert st.generation == 1 and st.model_path == str(checkpoint) and st.revision == ""

    # A layout that differs is refused with the tensors named; nothing changes.
    bigger = write_llama_checkpoint(tmp_path / "big", LlamaShape(
        hidden=TINY.hidden, layers=TINY.layers, intermediate=TINY.intermediate * 2,
        vocab=TINY.vocab, heads=TINY.heads, kv_heads=TINY.kv_heads), files=2)
    out = update(agent, model_path=str(bigger), revision="big")
    assert not out.ok and out.error == "layout_mismatch" and not out.broken
    assert "model.layers.0.mlp.up_proj.weight" in out.tensors
    # Two-phase, aborted after PAUSE: the old generation keeps serving on every rank.
    assert update(agent, agent_pb2.UPDATE_PHASE_PREPARE, model_path=str(revision2)).ok
    assert update(agent, agent_pb2.UPDATE_PHASE_PAUSE, model_path=str(revision2)).ok
    assert update(agent, agent_pb2.UPDATE_PHASE_ABORT).ok
    assert not update(agent, agent_pb2.UPDATE_PHASE_COMMIT).ok  # nothing left to commit
    assert [hello(r.socket_path)["update"]["generation"] for r in st.ranks] == [1, 1]

    out = update(agent, model_path=str(revision2), revision="r2")
    assert out.ok, out.message
    assert out.generation == 2 and out.revision == "r2" and out.bytes > 0
    st = agent.wait(lambda s: s.generation == 2, timeout=30)
    assert st.model_path == str(revision2) and st.revision == "r2"
    for rank in (0, 1):
        res = attach(revision2, socket_dir=agent.socket_dir, tp_size=2, tp_rank=rank,
                     fallback=False)
        assert res.source == "cache" and res.generation == 2

    code, text = agent.http("/metrics")
    assert code == 200
    where = 'cache="llama",namespace="default",node="gpu-a"'
    assert f'weightcache_cache_generation{{{where},rank="1",role="target"}} 2.0' in text
    assert f'weightcache_updates_total{{{where},result="ok"}} 2.0' in text  # one per rank
    assert f'weightcache_update_pause_seconds_count{{{where}}} 2.0' in text

    # A daemon restart loads the revision the engines were switched to.
    os.kill(hello(st.ranks[1].socket_path)["pid"], signal.SIGKILL)
    st = agent.wait(lambda s: s.restarts >= 1 and s.ready, timeout=90)
    res = attach(revision2, socket_dir=agent.socket_dir, tp_size=2, tp_rank=1, fallback=False)
    assert res.source == "cache"
