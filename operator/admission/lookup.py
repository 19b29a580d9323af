"""Which WeightCache an admission is for: kopf's index, with a bounded re-read of old copies.

An admission must answer within the webhook's timeout and never wait on the API server
for long, so the caches come from a kopf index filled by a watch; a copy older than
`index_max_age_s` is read again once (see `CacheLookup.__call__`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from weightcache import constants as C
from weightcache.operator import events
from weightcache.operator.admission.cacheview import CacheView
from weightcache.operator.admission.config import AdmissionConfig
from weightcache.operator.kube import ApiError

logger = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 1.0
MAX_REFRESHED = 4096  # re-read copies kept at most (bounded memory)


@dataclass(frozen=True)
class IndexedCache:
    view: CacheView
    ref: dict[str, str]
    at: float = field(default_factory=time.monotonic)  # when this copy was read
    pod_security: str | None = None  # status.podSecurity: the level the namespace enforces


def indexed(body: Any) -> IndexedCache:
    """The index entry for one WeightCache body (as kopf or the API server gives it)."""
    meta = body.get("metadata") or {}
    raw = {
        "metadata": dict(meta),
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }
    return IndexedCache(
        view=CacheView.from_object(raw),
        ref=events.cache_ref(meta),
        pod_security=raw["status"].get("podSecurity"),
    )


@dataclass
class CacheLookup:
    config: AdmissionConfig
    api: Any = None  # async get by path; None: the index only
    # Copies re-read because the index's was older than config.index_max_age_s.
    refreshed: dict[tuple[str, str], IndexedCache] = field(default_factory=dict)

    async def __call__(self, index: Any, namespace: str, name: str) -> IndexedCache | None:
        """The index first, while its copy is younger than `index_max_age_s`; else one GET.

        A miss is a cache created a moment ago, or a replica whose watch never ran. An old copy
        may be stale: kopf stops the watches of a replica that peering pauses (a standby), so
        its index keeps whatever it held when it stopped being the leader. Re-reading old copies
        bounds how stale an answer can be on any replica, at one GET per cache and period on
        the leader.
        """
        key = (namespace, name)
        store = index.get(key) if index is not None else None
        found = next(iter(store)) if store else None
        now = time.monotonic()
        max_age = self.config.index_max_age_s
        for copy in (found, self.refreshed.get(key)):
            if copy is not None and now - copy.at <= max_age:
                return copy
        if self.api is None:
            return found
        path = f"/apis/{C.GROUP}/{C.VERSION}/namespaces/{namespace}/{C.PLURAL}/{name}"
        try:
            obj = await asyncio.wait_for(self.api.get(path), LOOKUP_TIMEOUT_S)
        except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as exc:
            logger.warning("looking up WeightCache %s/%s failed: %s", namespace, name, exc)
            return found or self.refreshed.get(key)  # an old copy beats skipping injection
        if not obj:
            self.refreshed.pop(key, None)
            return None
        fresh = indexed(obj)
        if len(self.refreshed) >= MAX_REFRESHED:
            self.refreshed.clear()
        self.refreshed[key] = fresh
        return fresh
