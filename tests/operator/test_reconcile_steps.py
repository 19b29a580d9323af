"""Single steps of one reconciliation, each on its own (no API server)."""

from __future__ import annotations

import logging
from typing import Any

from weightcache.operator.handlers import Controller, Pass, PodInfo
from weightcache.operator.placement import NodeInfo, PlacementResult

LOG = logging.getLogger("test")


def _body(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 2},
        "spec": spec,
        "status": status or {},
    }


NATIVE = {"runtime": "native", "model": {"path": "/models/a", "revision": "r2"},
          "parallelism": {"tensor": 4, "nodes": 2}}


def _pod(name: str, node: str, epoch: int, digest: str, ready: bool = True) -> PodInfo:
    return PodInfo(name=name, node=node, ready=ready, epoch=str(epoch), plan_hash=digest,
                   restarts=0, rank_label=None, deleting=False, ip="10.0.0.1")


class Recorder(Controller):
    """A controller whose events are recorded instead of posted."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[tuple[str, str, str]] = []

    async def event(self, body: Any, kind: str, reason: str, message: str) -> None:
        self.posted.append((kind, reason, message))


def _pass(ctl: Controller, spec: dict[str, Any], status: dict[str, Any] | None = None,
          pods: list[PodInfo] = ()) -> Pass:
    nodes = {"n": [NodeInfo("a", gpus=2), NodeInfo("b", gpus=2)]}
    return Pass.start(ctl, _body(spec, status), nodes, {("ml", "llama"): list(pods)}, LOG)


def test_start_parses_the_spec_once_and_reads_the_served_model():
    served = {"path": "/models/a", "revision": "r1"}
    run = _pass(Controller(), NATIVE, {"model": served, "nodes": [
        {"node": "b", "rank": 1}, {"node": "a", "rank": 0}]})
    assert run.spec.socket_dir == "/var/run/weightcache/ml/llama"
    assert run.desired == {"path": "/models/a", "revision": "r2"} and run.served == served
    assert run.previous_nodes == ["a", "b"] and run.generation == 2


async def test_a_new_group_starts_at_epoch_one():
    ctl = Recorder()
    run = _pass(ctl, NATIVE)
    run.placement = PlacementResult(nodes=("a", "b"), eligible=2)
    await ctl._advance_epoch(run)
    assert run.epoch == 1 and ctl.posted == []


async def test_a_lost_node_restarts_the_group_under_a_new_epoch():
    ctl = Recorder()
    run = _pass(ctl, NATIVE, {"epoch": 3, "nodes": [{"node": "a", "rank": 0},
                                                    {"node": "c", "rank": 1}]})
    run.placement = PlacementResult(nodes=("a", "b"), eligible=2, replaced=("c",))
    await ctl._advance_epoch(run)
    assert run.epoch == 4
    assert [(kind, reason) for kind, reason, _ in ctl.posted] == [("Warning", "Replaced")]


async def test_vllm_recreates_on_a_new_model_at_once():
    ctl = Recorder()
    spec = {**NATIVE, "runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0"}
    run = _pass(ctl, spec, {"model": {"path": "/models/a", "revision": "r1"}})
    await ctl._recreate_on_new_model(run)
    assert run.served == run.desired
    assert run.update_cond is not None and run.update_cond.reason == "Recreated"
    assert [reason for _, reason, _ in ctl.posted] == ["Recreating"]


async def test_native_in_place_strategy_does_not_recreate():
    ctl = Recorder()
    run = _pass(ctl, NATIVE, {"model": {"path": "/models/a", "revision": "r1"}})
    await ctl._recreate_on_new_model(run)
    assert run.served != run.desired and run.update_cond is None and ctl.posted == []


def test_members_are_the_pods_of_this_epoch_and_plan():
    pods = [_pod("p-a", "a", 2, "h"), _pod("p-b", "b", 1, "h"), _pod("p-x", "x", 2, "h")]
    run = _pass(Controller(), NATIVE, pods=pods)
    run.placement = PlacementResult(nodes=("a", "b"), eligible=2)
    run.epoch, run.digest = 2, "h"
    run.observe_members()
    assert list(run.current) == ["a"]
    assert [(s.node, s.rank, s.ranks_total, s.pod, s.ready) for s in run.states] == [
        ("a", 0, 2, "p-a", True), ("b", 1, 2, "", False)]
