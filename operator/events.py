"""core/v1 Events about a WeightCache, shared by the reconciler and the admission webhook.

Both post events users read with `kubectl describe wc`; one builder keeps their shape (object
reference, timestamps, unique names, bounded message) the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from weightcache import constants as C
from weightcache.operator.status import now

MAX_MESSAGE = 1024


def cache_ref(meta: Mapping[str, Any]) -> dict[str, str]:
    """The involvedObject reference of a WeightCache, from its metadata."""
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
        "uid": meta.get("uid", ""),
    }


def event_body(
    ref: Mapping[str, str],
    *,
    type_: str,
    reason: str,
    message: str,
    component: str,
    reporting_component: str | None = None,
    reporting_instance: str | None = None,
) -> dict[str, Any]:
    """A core/v1 Event on `ref`. A unique name (no generateName) needs one POST, no read."""
    stamp = now()
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{ref['name']}.{uuid.uuid4().hex[:16]}",
            "namespace": ref["namespace"],
        },
        "involvedObject": dict(ref),
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": component},
        "reportingComponent": reporting_component or component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    if reporting_instance:
        body["reportingInstance"] = reporting_instance
    return body


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/events"
