"""How the webhook finds a cache: the index while fresh, a bounded re-read once old."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.admission.conftest import cache_obj
from weightcache.operator.admission import lookup
from weightcache.operator.admission.config import AdmissionConfig


class CountingApi:
    """A stand-in API server holding one object: counts GETs, answers None for others."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = obj
        self.gets: list[str] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        return self.obj


def _lookup(state: Any, index: Any, name: str) -> Any:
    return asyncio.run(state(index, "serving", name))


def test_fresh_index_copy_needs_no_api_call() -> None:
    cache = cache_obj()
    name = cache["metadata"]["name"]
    api = CountingApi(cache)
    state = lookup.CacheLookup(config=AdmissionConfig(index_max_age_s=60), api=api)
    index = {("serving", name): [lookup.indexed(cache)]}
    found = _lookup(state, index, name)
    assert found is not None and found.ref["name"] == name
    assert api.gets == []


def test_old_index_copy_is_reread_once_then_served_fresh() -> None:
    """A standby's index stops with its watch: old copies are re-read, one GET per period."""
    old = cache_obj()
    name = old["metadata"]["name"]
    newer = cache_obj(engine={"mode": "copy"})
    api = CountingApi(newer)
    state = lookup.CacheLookup(config=AdmissionConfig(index_max_age_s=30), api=api)
    stale = lookup.indexed(old)
    object.__setattr__(stale, "at", stale.at - 31)  # indexed 31 s ago
    index = {("serving", name): [stale]}
    first = _lookup(state, index, name)
    second = _lookup(state, index, name)
    assert len(api.gets) == 1 and api.gets[0].endswith(f"/weightcaches/{name}")
    assert first is second
    assert first.view.mode == "copy" and stale.view.mode != "copy"


def test_deleted_cache_is_not_served_from_an_old_copy() -> None:
    cache = cache_obj()
    name = cache["metadata"]["name"]
    state = lookup.CacheLookup(config=AdmissionConfig(index_max_age_s=1), api=CountingApi(None))
    stale = lookup.indexed(cache)
    object.__setattr__(stale, "at", stale.at - 5)
    assert _lookup(state, {("serving", name): [stale]}, name) is None


def test_api_failure_falls_back_to_the_old_copy() -> None:
    class FailingApi:
        async def get(self, path: str) -> Any:
            raise OSError("connection refused")

    cache = cache_obj()
    name = cache["metadata"]["name"]
    state = lookup.CacheLookup(config=AdmissionConfig(index_max_age_s=1), api=FailingApi())
    stale = lookup.indexed(cache)
    object.__setattr__(stale, "at", stale.at - 5)
    assert _lookup(state, {("serving", name): [stale]}, name) is stale
