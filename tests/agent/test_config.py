"""Start-up configuration: plan parsing, node rank, device discovery."""

from __future__ import annotations

import copyreg
import json
import os
import pickle

import pytest

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent.config import (
    AgentEnv,
    ConfigError,
    build_config,
    discover_devices,
    parse_plan,
    read_plan,
)
from weightcache.agent.metrics import _Accumulator, result_class
from weightcache.agent.vllm_probe import safe_loads

ENV = {"WEIGHTCACHE_CACHE_NAME": "llama", "WEIGHTCACHE_NAMESPACE": "default",
       "NODE_NAME": "gpu-b", "POD_IP": "10.0.0.7", "WEIGHTCACHE_PLAN": "/x/plan.json"}


def test_env_and_node_rank():
    env = AgentEnv.from_environ(ENV)
    assert (env.cache, env.node, env.pod_ip, env.plan_path) == ("llama", "gpu-b", "10.0.0.7",
                                                                "/x/plan.json")
    plan = parse_plan(json.dumps(make_plan(tensor=16, nodes=2)))
    cfg = build_config(env, plan, {"NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(8))})
    assert (cfg.node_rank, cfg.node_count, cfg.local_world_size) == (1, 2, 8)
    assert cfg.master_addr == "llama-rendezvous.default.svc"
    assert cfg.socket_dir == "/var/run/weightcache/default/llama"
    assert cfg.ports["grpc"] == 9479 and cfg.multi_node


def test_missing_env_named():
    with pytest.raises(ConfigError, match="NODE_NAME"):
        AgentEnv.from_environ({k: v for k, v in ENV.items() if k != "NODE_NAME"})


@pytest.mark.parametrize(("doc", "message"), [
    ("[]", "top level must be a JSON object"),
    ('{"runtime": "vllm"}', "nodeCount must be an integer"),
    (json.dumps({**make_plan(), "nodes": []}), "nodes must be a non-empty list"),
    (json.dumps({**make_plan(), "nodeCount": True}), "nodeCount must be an integer"),
    (json.dumps({**make_plan(), "spec": {"model": {}}}), "spec.model.path"),
    (json.dumps({**make_plan(tensor=3, nodes=1), "nodeCount": 2,
                 "nodes": [{"node": "a", "rank": 0}, {"node": "b", "rank": 1}]}),
     "does not split evenly over 2 nodes"),
    (json.dumps({**make_plan(), "nodes": [{"node": "a", "rank": 0}, {"node": "a", "rank": 0}]}),
     "appears twice"),
    ("x" * (1 << 21), "byte limit"),
])
def test_plan_refusals(doc, message):
    with pytest.raises(ConfigError, match=message):
        parse_plan(doc)


def test_plan_file_missing(tmp_path):
    with pytest.raises(ConfigError, match="is the placement ConfigMap mounted"):
        read_plan(str(tmp_path / "plan.json"))


def test_nvidia_smi_discovery(tmp_path):
    smi = tmp_path / "nvidia-smi"
    rows = "\n".join(f"{i}, {u}" for i, u in enumerate(gpu_uuids(4)))
    smi.write_text(f"#!/bin/sh\necho '{rows}'\n")
    smi.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    found = discover_devices("cuda", 4, {**env, "NVIDIA_VISIBLE_DEVICES": "all"})
    assert [d.uuid for d in found] == gpu_uuids(4)
    listed = discover_devices("cuda", 2, {**env, "NVIDIA_VISIBLE_DEVICES": ",".join(
        reversed(gpu_uuids(2)))})
    assert [(d.index, d.uuid) for d in listed] == [(0, gpu_uuids(2)[1]), (1, gpu_uuids(2)[0])]
    with pytest.raises(ConfigError, match="sees no GPU"):
        discover_devices("cuda", 1, {**env, "NVIDIA_VISIBLE_DEVICES": "void"})
    with pytest.raises(ConfigError, match="nvidia-smi is not on PATH"):
        discover_devices("cuda", 1, {"PATH": str(tmp_path / "empty")})


def test_cpu_identities_are_stable():
    a = discover_devices("cpu", 3, {})
    assert [d.index for d in a] == [0, 1, 2] and a == discover_devices("cpu", 3, {})
    assert len({d.uuid for d in a}) == 3 and all(d.kind == "cpu" for d in a)


class _Boom:
    def __reduce__(self):
        return (os.getcwd, ())


def test_safe_unpickler_allows_only_plain_data():
    plain = {"status": "ok", "memory_bytes": 7, "x": [1.5, None, True, (b"b", {"s"})]}
    assert safe_loads(pickle.dumps(plain, protocol=5)) == plain
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        safe_loads(pickle.dumps({"m": _Boom()}))
    copyreg.add_extension("os", "getcwd", 240)
    try:
        with pytest.raises(pickle.UnpicklingError):
            safe_loads(pickle.dumps(os.getcwd, protocol=2))
    finally:
        copyreg.remove_extension("os", "getcwd", 240)


def test_counter_accumulator_survives_daemon_restart():
    acc = _Accumulator()
    acc.observe((0, "t"), ("req", "get_state", "ok"), 5)
    acc.observe((1, "t"), ("req", "get_state", "ok"), 2)
    acc.observe((0, "t"), ("req", "get_state", "ok"), 1)  # rank 0 restarted
    assert acc.totals("req") == {("get_state", "ok"): 8}
    assert [result_class(r) for r in ("ok", "fingerprint_mismatch", "released", "x")] == [
        "ok", "mismatch", "error", "error"]


def test_mismatch_labels_come_from_a_fixed_set():
    """A daemon (or anything on its socket) reporting 24k mismatch fields adds one series
    `other`, not 24k; the fingerprint's own fields keep their names."""
    from types import SimpleNamespace

    from weightcache.agent.metrics import AgentCollector
    from weightcache.agent.runtimes.base import RankSpec
    from weightcache.agent.supervisor import RankStatus, Snapshot, State

    spec = RankSpec(role="target", global_rank=0, tp_rank=0, dp_rank=0, local_index=0,
                    device=SimpleNamespace(uuid="cpu-x-0"), socket_path="/nonexistent")
    stats = {"mismatches": {"content": 3, **{f"junk{i}": 1 for i in range(24_000)}},
             "requests": {"get_state": {"ok": 1, **{f"e{i}": 1 for i in range(100)}},
                          **{f"cmd{i}": {"ok": 1} for i in range(100)}},
             "attach_seconds": {"buckets": [[i, 1] for i in range(1000)], "sum": 1.0},
             "watchers": 1}
    snap = Snapshot(ranks=[RankStatus(spec=spec, state=State.READY, stats=stats)], epoch=1,
                    restarts=0, held=False, released=False, ready=True, alive=True, message="")
    supervisor = SimpleNamespace(snapshot=lambda: snap,
                                 runtime=SimpleNamespace(collect_stats=lambda: True))
    cfg = SimpleNamespace(env=SimpleNamespace(cache="c", namespace="n", node="x"),
                          plan=SimpleNamespace(runtime="native"))
    families = {m.name: m for m in AgentCollector(cfg, supervisor).collect()}
    fields = {s.labels["field"]: s.value for s in families["weightcache_fingerprint_mismatches"]
              .samples}
    assert fields == {"content": 3.0, "other": 24_000.0}
    requests = {(s.labels["command"], s.labels["result"]) for s in
                families["weightcache_daemon_requests"].samples}
    assert requests == {("get_state", "ok"), ("get_state", "error"), ("other", "ok")}
    assert len(families["weightcache_attach_duration_seconds"].samples) <= 32 + 3


@pytest.mark.parametrize("updates", [
    {"generation": 2, "update_seconds": {"buckets": [["x", 1]]}},
    [1],
    {"results": [1], "pause_seconds": {"buckets": [[i, 1] for i in range(5000)]}},
    None,
])
def test_bad_update_stats_never_fail_the_scrape(updates):
    """Update stats come from the daemon like every other stat: a malformed value must not
    raise inside `collect` (the whole /metrics scrape would fail, and with it rank_ready),
    and histogram bounds stay capped."""
    from types import SimpleNamespace

    from weightcache.agent.metrics import AgentCollector
    from weightcache.agent.runtimes.base import RankSpec
    from weightcache.agent.supervisor import RankStatus, Snapshot, State

    spec = RankSpec(role="target", global_rank=0, tp_rank=0, dp_rank=0, local_index=0,
                    device=SimpleNamespace(uuid="cpu-x-0"), socket_path="/nonexistent")
    snap = Snapshot(ranks=[RankStatus(spec=spec, state=State.READY,
                                      stats={"updates": updates, "watchers": 1})],
                    epoch=1, restarts=0, held=False, released=False, ready=True, alive=True,
                    message="")
    supervisor = SimpleNamespace(snapshot=lambda: snap,
                                 runtime=SimpleNamespace(collect_stats=lambda: True))
    cfg = SimpleNamespace(env=SimpleNamespace(cache="c", namespace="n", node="x"),
                          plan=SimpleNamespace(runtime="native"))
    families = {m.name: m for m in AgentCollector(cfg, supervisor).collect()}
    assert [s.value for s in families["weightcache_rank_ready"].samples] == [1.0]
    for name, fam in families.items():
        assert len(fam.samples) <= 32 + 3, name


def test_a_reply_of_shared_references_is_refused_fast(tmp_path):
    """4 KB of pickle that describes 2**60 list nodes through the memo: the probe refuses
    it after a bounded walk instead of formatting it (the unbounded version ran 29 s and
    ended in MemoryError). A real Unix socket plays the daemon."""
    import socket
    import struct
    import threading

    from weightcache.agent import vllm_probe

    bomb: list = []
    for _ in range(60):
        bomb = [bomb, bomb]
    payload = pickle.dumps({"status": "error", "message": bomb}, protocol=4)
    assert len(payload) < 4096
    path = str(tmp_path / "vllm.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            (n,) = struct.unpack("!Q", conn.recv(8))
            conn.recv(n)
            conn.sendall(struct.pack("!Q", len(payload)) + payload)

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(vllm_probe.ProbeError, match=r"more than|deeper than"):
        vllm_probe.get_memory(path, timeout=5)
    server.close()
    ok = {"status": "error", "message": "x" * 10_000}
    vllm_probe.check_plain(ok)
    assert len(vllm_probe._message(ok)) <= vllm_probe.MAX_MESSAGE + 3
