"""Events on the WeightCache for what admission found wrong with an engine pod.

A warning reaches only whoever ran kubectl; a Deployment's pods are created by a controller,
so each mismatch also becomes a Warning event on the cache (deduplicated, bounded, best
effort: admission has already answered when it is posted).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from weightcache import constants as C
from weightcache.operator import events
from weightcache.operator.admission.config import AdmissionConfig
from weightcache.operator.admission.lookup import IndexedCache

logger = logging.getLogger(__name__)
MAX_PENDING_EVENTS = 100


def pod_label(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    name = meta.get("name") or (meta.get("generateName", "") + "*")
    owners = meta.get("ownerReferences") or []
    owner = f" (of {owners[0].get('kind')} {owners[0].get('name')})" if owners else ""
    return f"pod {meta.get('namespace', '')}/{name}{owner}"


@dataclass
class Notifier:
    config: AdmissionConfig
    api: Callable[[], Any]  # the API client once startup made one
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    pending: Callable[[], int]  # background tasks in flight
    sent: dict[tuple[str, str, str], float] = field(default_factory=dict)

    async def post(self, ref: dict[str, str], reason: str, message: str) -> None:
        body = events.event_body(
            ref,
            type_="Warning",
            reason=reason,
            message=message,
            component="weightcache-webhook",
            reporting_component=f"{C.GROUP}/webhook",
            reporting_instance=socket.gethostname(),
        )
        try:
            await self.api().create(events.events_path(ref["namespace"]), body)
        except Exception as exc:  # an event is best effort; admission already answered
            logger.warning("posting event on WeightCache %s failed: %s", ref.get("name"), exc)

    def mismatches(self, cache: IndexedCache, pod: dict[str, Any], found: list[str]) -> None:
        if self.api() is None or not found or self.pending() >= MAX_PENDING_EVENTS:
            return  # an API server that does not take events must not pile up tasks here
        now = time.monotonic()
        message = f"{pod_label(pod)}: " + "; ".join(found)
        key = (cache.ref["namespace"], cache.ref["name"], "; ".join(found))
        last = self.sent.get(key)
        if last is not None and now - last < self.config.event_dedupe_s:
            return
        if len(self.sent) > 1000:  # bounded: forget the oldest half
            for k in sorted(self.sent, key=self.sent.__getitem__)[:500]:
                del self.sent[k]
        self.sent[key] = now
        self.spawn(self.post(cache.ref, "EngineMismatch", message))
