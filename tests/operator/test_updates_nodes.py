"""Updates across nodes with real parts: the real kopf operator against kmock, two real
`weightcache agent` processes (nodes gpu-a on 127.0.0.1 and gpu-b on 127.0.0.2, one gRPC port,
as pods of a DaemonSet), each supervising a real native daemon on its own socket directory
(CPU, memfd), and on each node a real engine process (tests/agent/update_engine.py) that
follows updates behind a gate and keeps checking which revision's exact bytes it maps.

What is asserted is the group's promise (docs/updates.md "Groups and nodes"): both nodes
switch at one barrier, at the same addresses, or neither does; a refusal on one node changes
no node and the condition says why; a node whose daemon dies after PAUSE rolls the other node
back (reason RolledBack) with no engine left paused and no torn bytes served; an operator
restarted mid-update converges. The update runs beside the reconciler (operator/updatetask.py):
while one node is slow to pause, a spec change of the same cache is reconciled at once and
stops the update, and a deletion stops it with no engine left paused. A node that fails after
the first node committed is reported node by node (PartiallyUpdated).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import Agent
from tests.agent.plans import make_plan
from tests.agent.test_native_e2e import hello
from tests.operator.conftest import NS, cache_url, eventually, running_operator
from tests.operator.test_operator import phase_is
from weightcache.native.engine.attach import attach, query
from weightcache.testing.checkpoints import TINY, write_llama_checkpoint
from weightcache.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
NODES = (("gpu-a", "127.0.0.1"), ("gpu-b", "127.0.0.2"))


@pytest.fixture(scope="module")
def revisions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two revisions of one tiny model: same headers and layout, other bytes."""
    root = tmp_path_factory.mktemp("revs")
    return {label: write_llama_checkpoint(root / label, TINY, files=2, seed=seed)
            for label, seed in (("A", 0), ("B", 1))}


class Node:
    """One node: its agent (and so its daemon) and its engine process."""

    def __init__(self, agent: Agent, status: Path) -> None:
        self.agent, self.status_path = agent, status
        self.engine: subprocess.Popen[bytes] | None = None

    def start_engine(self, revisions: dict[str, Path], *hooks: str) -> None:
        args = [sys.executable, "-m", "tests.agent.update_engine", "--model",
                str(revisions["A"]), "--socket-dir", self.agent.socket_dir,
                "--status", str(self.status_path), *hooks]
        for label, path in revisions.items():
            args += ["--revision", label, str(path)]
        log = open(self.status_path.with_suffix(".log"), "ab")  # noqa: SIM115
        self.engine = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)

    def status(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.status_path.read_text())
        return {}

    def engine_log(self) -> str:
        path = self.status_path.with_suffix(".log")
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def daemon_pid(self) -> int:
        st = self.agent.status()
        return int(hello(st.ranks[0].socket_path)["pid"])

    def stop(self) -> None:
        if self.engine is not None and self.engine.poll() is None:
            self.engine.send_signal(signal.SIGTERM)
            try:
                self.engine.wait(10)
            except subprocess.TimeoutExpired:
                self.engine.kill()
                self.engine.wait()


@pytest.fixture
def nodes(tmp_path: Path, revisions) -> Iterator[tuple[int, list[Node]]]:
    """Two agents serving revision A, one gRPC port on two loopback addresses."""
    grpc_port = free_port()
    started: list[Node] = []
    try:
        for name, host in NODES:
            plan = make_plan(runtime="native", model=str(revisions["A"]),
                             spec_extra={"device": "cpu"})
            plan["nodes"] = [{"node": name, "rank": 0}]
            agent = Agent(tmp_path, plan, node=name, host=host, ports={"grpc": grpc_port})
            started.append(Node(agent.start(), tmp_path / f"engine-{name}.json"))
        for node in started:
            node.agent.wait_ready(timeout=90)
        yield grpc_port, started
    finally:
        for node in started:
            node.stop()
        for node in started:
            node.agent.close()


async def engines_serve(nodes: list[Node], label: str, **expect: Any) -> list[dict]:
    """Wait until every engine runs (gate open) on revision `label`'s exact bytes."""
    async def check():
        out = [n.status() for n in nodes]
        ok = all(s.get("serving") == label and not s.get("paused")
                 and all(s.get(k) == v for k, v in expect.items()) for s in out)
        return out if ok else None

    try:
        return await eventually(check, timeout=60)
    except AssertionError:
        raise AssertionError("\n".join(n.engine_log() for n in nodes)) from None


async def ready_cache(cluster, port: int, revisions: dict[str, Path]) -> None:
    for name, _ in NODES:
        await cluster.add_node(name)
    await cluster.create_cache("llama", {
        "runtime": "native",
        "model": {"path": str(revisions["A"]), "mountPath": str(revisions["A"].parent)},
        "parallelism": {"tensor": 16, "nodes": 2}, "ports": {"grpc": port}})
    await phase_is(cluster, "llama", "Placing")
    pods = await cluster.materialize("llama", ready=True, ip="127.0.0.1")
    hosts = dict(NODES)
    for pod in pods:  # the operator reaches each agent at its pod IP
        await cluster.patch(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                            {"status": {"podIP": hosts[pod["spec"]["nodeName"]]}})
    await phase_is(cluster, "llama", "Ready")


async def update_to(cluster, path: Path, revision: str, generation: int) -> None:
    await cluster.patch(cache_url("llama"), {"metadata": {"generation": generation}, "spec": {
        "model": {"path": str(path), "revision": revision}}})


async def updating(cluster, reason: str, timeout: float = 60) -> dict:
    async def check():
        status = await cluster.status("llama")
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Updating"), None)
        return cond if cond and cond["reason"] == reason else None

    return await eventually(check, timeout=timeout)


def generations(nodes: list[Node]) -> list[int]:
    return [int(n.agent.status().generation) for n in nodes]


async def test_two_nodes_switch_together_at_the_same_addresses(cluster, nodes, revisions):
    port, group = nodes
    for node in group:
        node.start_engine(revisions)
    async with running_operator():
        await ready_cache(cluster, port, revisions)
        await engines_serve(group, "A", addresses_kept=True)
        await update_to(cluster, revisions["B"], "b", 2)
        cond = await updating(cluster, "Updated")
        assert "on 2 node(s), generation 2" in cond["message"]
        assert "without rollback" not in cond["message"]  # both kept a copy of revision A
        out = await engines_serve(group, "B", addresses_kept=True, generation=2)
        status = await cluster.status("llama")
    assert status["model"] == {"path": str(revisions["B"]), "revision": "b"}
    assert [(n["generation"], n["revision"]) for n in status["nodes"]] == [(2, "b")] * 2
    for st in out:  # paused once, switched once, never saw anything but whole revisions
        assert st["events"] == ["pause", "finish"] and st["seen"] == ["A", "B"]
        assert st["source"] == "cache" and st["reattached"] == 0
    assert generations(group) == [2, 2]


async def test_a_node_refusing_at_prepare_changes_no_node(cluster, nodes, revisions):
    """gpu-b has an engine attached zero_copy that cannot pause: only that node refuses."""
    port, group = nodes
    for node in group:
        node.start_engine(revisions)
    blocker = attach(revisions["A"], socket_dir=group[1].agent.socket_dir, mode="zero_copy",
                     fallback=False)  # this test process, without an update participant
    assert blocker.source == "cache"
    async with running_operator():
        await ready_cache(cluster, port, revisions)
        await engines_serve(group, "A")
        await update_to(cluster, revisions["B"], "b", 2)
        cond = await updating(cluster, "EngineCannotPause")
        status = await cluster.status("llama")
        out = await engines_serve(group, "A", generation=1)
    assert f"pid {os.getpid()}" in cond["message"] and "127.0.0.2" in cond["message"]
    assert f"still serving {revisions['A']}@" in cond["message"]
    assert status["model"]["path"] == str(revisions["A"]) and status["phase"] == "Ready"
    for st in out:  # nobody paused, nobody switched
        assert st["events"] == [] and st["seen"] == ["A"]
    assert generations(group) == [1, 1]
    del blocker


async def test_a_node_dying_after_pause_rolls_every_node_back(cluster, nodes, revisions):
    """gpu-b's daemon is killed right after its engine paused; gpu-a's engine acks late, so the
    operator's WRITE reaches gpu-a (which writes revision B) and a dead daemon on gpu-b.
    gpu-a writes its kept copy of revision A back: no node serves B, none is broken."""
    port, group = nodes
    a, b = group
    a.start_engine(revisions, "--pause-sleep", "1.5")
    b.start_engine(revisions, "--pause-kill", str(b.daemon_pid()), "--kill-delay", "0.2")
    ptrs_before = None
    async with running_operator():
        await ready_cache(cluster, port, revisions)
        await engines_serve(group, "A")
        ptrs_before = a.status()
        await update_to(cluster, revisions["B"], "b", 2)
        cond = await updating(cluster, "RolledBack")
        out = await engines_serve(group, "A")  # gpu-b's engine attached again
        status = await cluster.status("llama")
    assert "rolled back" in cond["message"] and "127.0.0.2" in cond["message"], cond
    assert status["model"]["path"] == str(revisions["A"])
    assert ptrs_before["addresses_kept"]
    st_a, st_b = out
    # gpu-a: paused, written, rolled back in the same memory, resumed unchanged.
    assert st_a["events"] == ["pause", "resumed"] and st_a["addresses_kept"]
    assert st_a["generation"] == 1 and st_a["seen"] == ["A"] and st_a["reattached"] == 0
    # gpu-b: told its daemon went away mid-update, reloaded, serves A; never B, never torn.
    assert st_b["events"][:2] == ["pause", "broken"] and st_b["reattached"] >= 1
    assert st_b["seen"] == ["A"]
    assert generations(group) == [1, 1]
    # The daemon of gpu-a counted a rollback; gpu-b's was restarted by its agent on A.
    sock_a = a.agent.status().ranks[0].socket_path
    updates = hello(sock_a)["update"]
    assert updates["generation"] == 1 and updates["phase"] == "idle" and not updates["broken"]
    assert query(sock_a, "stats")["updates"]["results"] == {"rolled_back": 1}  # it had written
    assert b.agent.status().restarts >= 1


async def test_an_operator_restarted_mid_update_converges(cluster, nodes, revisions):
    """The operator stops while gpu-a's engine is still pausing (both nodes prepared, gpu-b
    paused); a new operator finds the held updates, aborts them and updates the group."""
    port, group = nodes
    a, b = group
    a.start_engine(revisions, "--pause-sleep", "2")
    b.start_engine(revisions)
    async with running_operator():
        await ready_cache(cluster, port, revisions)
        await engines_serve(group, "A")
        await update_to(cluster, revisions["B"], "b", 2)

        async def pausing():
            return "pause" in a.status().get("events", [])

        await eventually(pausing, timeout=30)
        stopped_at = time.monotonic()
    cond = next((c for c in (await cluster.status("llama")).get("conditions", [])
                 if c["type"] == "Updating"), {})
    async with running_operator():
        await updating(cluster, "Updated")
        out = await engines_serve(group, "B", addresses_kept=True, generation=2)
    assert time.monotonic() - stopped_at < 60
    for st in out:
        assert st["seen"] == ["A", "B"] and st["reattached"] == 0
        assert st["events"][-1] == "finish"
    assert generations(group) == [2, 2]
    assert cond.get("reason") != "Updated", "the first operator finished before it stopped"


async def slow_pause_mid_update(cluster, port: int, group: list[Node], revisions,
                                pause_s: float) -> None:
    """Serve A, then update to B with gpu-a's engine taking `pause_s` to pause; returns while
    gpu-a pauses and gpu-b is paused (the update is between PAUSE and WRITE)."""
    a, b = group
    a.start_engine(revisions, "--pause-sleep", str(pause_s))
    b.start_engine(revisions)
    await ready_cache(cluster, port, revisions)
    await engines_serve(group, "A")
    await update_to(cluster, revisions["B"], "b", 2)

    async def pausing():
        return "pause" in a.status().get("events", []) and b.status().get("paused")

    await eventually(pausing, timeout=30)


def cache_gone(cluster):
    async def check():
        return await cluster.cache("llama") is None
    return check


async def test_a_spec_change_during_a_slow_pause_is_reconciled_at_once_and_stops_it(
        cluster, nodes, revisions):
    """gpu-a's engine takes 15 s to pause. spec.model goes back to A while gpu-a pauses: the
    pass is not queued behind the update (status follows the new generation within seconds),
    the update is stopped before COMMIT and no engine ever runs B."""
    port, group = nodes
    async with running_operator():
        await slow_pause_mid_update(cluster, port, group, revisions, 15)
        await update_to(cluster, revisions["A"], "", 3)
        asked = time.monotonic()

        async def reconciled():
            status = await cluster.status("llama")
            return status if status.get("observedGeneration") == 3 else None

        status = await eventually(reconciled, timeout=8)  # gpu-a still sleeps in its pause
        seen_after = time.monotonic() - asked
        cond = await updating(cluster, "Serving", timeout=60)
        out = await engines_serve(group, "A", generation=1)
    assert "pause" in group[0].status()["events"] and seen_after < 8
    superseding = next(c for c in status["conditions"] if c["type"] == "Updating")
    assert superseding["reason"] == "Superseding", superseding
    assert f"{revisions['B']}@b" in superseding["message"]
    assert "stopped before COMMIT" in cond["message"], cond
    for st in out:  # paused once, resumed unchanged, never saw B
        assert st["events"] == ["pause", "resumed"] and st["seen"] == ["A"], st
    assert generations(group) == [1, 1]
    assert status["model"]["path"] == str(revisions["A"])


async def test_a_deletion_during_an_update_leaves_no_engine_paused(cluster, nodes, revisions):
    """The cache is deleted while gpu-a's engine takes 12 s to pause (gpu-b's already paused):
    the deletion stops the update, every node aborts, both engines resume on A once gpu-a's
    pause ends (not after the agents' 30 s hold), and nothing switches to B."""
    port, group = nodes
    async with running_operator():
        await slow_pause_mid_update(cluster, port, group, revisions, 12)
        started = time.monotonic()
        await cluster.delete(cache_url("llama"))
        await eventually(cache_gone(cluster), timeout=40)

        async def resumed():
            out = [n.status() for n in group]
            return out if all(s.get("events") == ["pause", "resumed"] and not s.get("paused")
                              for s in out) else None

        out = await eventually(resumed, timeout=25)  # the agents' hold would be 30 s more
        waited = time.monotonic() - started
    for st in out:
        assert st["seen"] == ["A"] and st["generation"] == 1, st
    assert waited < 25
    for node in group:
        update = hello(node.agent.status().ranks[0].socket_path)["update"]
        assert update["phase"] == "idle" and update["generation"] == 1 and not update["broken"]


async def test_a_node_failing_after_the_first_commit_is_reported_node_by_node(
        cluster, nodes, revisions):
    """gpu-a (rank 0) commits first; the moment its engine is told, gpu-b's daemon is killed,
    so gpu-b's COMMIT fails. Nothing can undo gpu-a (its engines run B, its daemon no longer
    holds A): the condition says which node serves which generation, and so does status."""
    port, group = nodes
    a, b = group
    a.start_engine(revisions, "--finish-kill", str(b.daemon_pid()))
    b.start_engine(revisions)
    async with running_operator():
        await ready_cache(cluster, port, revisions)
        await engines_serve(group, "A")
        await update_to(cluster, revisions["B"], "b", 2)
        cond = await updating(cluster, "PartiallyUpdated")

        async def settled():
            st_a, st_b = a.status(), b.status()
            return ((st_a, st_b) if st_a.get("serving") == "B" and st_b.get("serving") == "A"
                    and not st_a.get("paused") and not st_b.get("paused") else None)

        st_a, st_b = await eventually(settled, timeout=60)
        status = await cluster.status("llama")
    message = cond["message"]
    assert f"{revisions['B']}@b is served by gpu-a generation 2" in message, message
    assert "not by gpu-b (127.0.0.2:" in message, message
    assert status["model"]["path"] == str(revisions["A"])  # the group as a whole: not B
    by_node = {n["node"]: (n["generation"], n["revision"]) for n in status["nodes"]}
    assert by_node == {"gpu-a": (2, "b"), "gpu-b": (1, "")}, by_node
    assert st_a["events"] == ["pause", "finish"] and st_a["seen"] == ["A", "B"]
    assert st_b["events"][:2] == ["pause", "broken"] and st_b["seen"] == ["A"]
    assert generations(group)[0] == 2
