"""Conditions keep their transition time until they flip; phase changes name their event."""

from __future__ import annotations

from weightcache.operator import status as S
from weightcache.operator.spec import Problem


def _nodes(ready: bool) -> list[S.NodeState]:
    return [S.NodeState("a", 0, 8, "p-a", ready), S.NodeState("b", 1, 8, "p-b", ready)]


def test_loading_ready_degraded_and_stable_transition_times():
    loading = S.observed({}, nodes=_nodes(False), pods_seen=2, epoch=1, generation=1)
    assert loading["phase"] == "Loading" and loading["ranks"] == "0/16"
    ready = S.observed(loading, nodes=_nodes(True), pods_seen=2, epoch=1, generation=1)
    assert ready["phase"] == "Ready" and ready["ranksReady"] == 16
    assert S.transition_event(loading, ready) == (
        "Normal",
        "Ready",
        "16/16 ranks ready on 2 node(s)",
    )
    degraded = S.observed(
        ready, nodes=[_nodes(True)[0], _nodes(False)[1]], pods_seen=2, epoch=1, generation=1
    )
    assert degraded["phase"] == "Degraded"
    cond = {c["type"]: c for c in degraded["conditions"]}
    assert cond["Degraded"]["status"] == "True" and "not ready on b" in cond["Degraded"]["message"]
    # Writing the same observation again changes nothing: no status write, no event.
    again = S.observed(degraded, nodes=degraded_nodes(), pods_seen=2, epoch=1, generation=1)
    assert S.same(degraded, again) and S.transition_event(degraded, again) is None


def degraded_nodes() -> list[S.NodeState]:
    return [_nodes(True)[0], _nodes(False)[1]]


def test_a_new_generation_or_epoch_is_a_rollout_not_degradation():
    ready = S.observed({}, nodes=_nodes(True), pods_seen=2, epoch=1, generation=1)
    rolled = S.observed(ready, nodes=_nodes(False), pods_seen=2, epoch=1, generation=2)
    assert rolled["phase"] == "Loading"
    restarted = S.observed(ready, nodes=_nodes(False), pods_seen=0, epoch=2, generation=1)
    assert restarted["phase"] == "Placing"


def test_invalid_and_unschedulable_messages_are_evented_when_they_change():
    first = S.invalid({}, [Problem("spec.image", "pin it")], 1)
    assert S.transition_event({}, first) == ("Warning", "InvalidSpec", "spec.image: pin it")
    second = S.invalid(first, [Problem("spec.ports.grpc", "collides")], 2)
    assert S.transition_event(first, second)[1] == "InvalidSpec"
    unsched = S.unschedulable({}, need=4, eligible=1, reasons={"NotReady": 2}, generation=1)
    cond = {c["type"]: c for c in unsched["conditions"]}
    assert cond["Progressing"]["reason"] == "Unschedulable"
    assert cond["Degraded"]["status"] == "False"  # never placed: nothing degraded
    assert "3 missing" in unsched["message"] and "2 NotReady" in unsched["message"]
