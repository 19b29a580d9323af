"""Admission webhooks: inject opted-in engine pods, validate WeightCaches.

`register(registry, config)` installs everything on a kopf registry (docs/interfaces.md,
"Admission"): an index of WeightCaches so an admission needs no API call, the mutating
and validating handlers, and a startup activity that prepares certificates, writes the
webhook configurations and hands kopf a `WebhookServer`. The decisions themselves are
pure functions in `mutate` and `validate`.
May import: the operator's modules, `weightcache.constants` and `weightcache.contracts`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from weightcache import constants as C
from weightcache.operator import events
from weightcache.operator.admission import keeper, metrics, mutate, podsecurity, validate
from weightcache.operator.admission.config import (
    INDEX_ID,
    MUTATE_ID,
    VALIDATE_ID,
    AdmissionConfig,
    add_arguments,
    mutating_configuration,
    validating_configuration,
)
from weightcache.operator.kube import ApiError, Kube

__all__ = [
    "AdmissionConfig",
    "add_arguments",
    "mutating_configuration",
    "register",
    "validating_configuration",
]

logger = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 1.0
MAX_REFRESHED = 4096  # re-read copies kept at most (bounded memory)
MAX_PENDING_EVENTS = 100


@dataclass(frozen=True)
class IndexedCache:
    view: mutate.CacheView
    ref: dict[str, str]
    at: float = field(default_factory=time.monotonic)  # when this copy was read
    pod_security: str | None = None  # status.podSecurity: the level the namespace enforces


@dataclass
class _State:
    config: AdmissionConfig
    api: Any = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    events_sent: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # Copies re-read because the index's was older than config.index_max_age_s.
    refreshed: dict[tuple[str, str], IndexedCache] = field(default_factory=dict)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _indexed(body: Any) -> IndexedCache:
    meta = body.get("metadata") or {}
    raw = {
        "metadata": dict(meta),
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }
    return IndexedCache(
        view=mutate.CacheView.from_object(raw),
        ref=events.cache_ref(meta),
        pod_security=raw["status"].get("podSecurity"),
    )


def _pod_label(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    name = meta.get("name") or (meta.get("generateName", "") + "*")
    owners = meta.get("ownerReferences") or []
    owner = f" (of {owners[0].get('kind')} {owners[0].get('name')})" if owners else ""
    return f"pod {meta.get('namespace', '')}/{name}{owner}"


async def _lookup(state: _State, index: Any, namespace: str, name: str) -> IndexedCache | None:
    """The index first, while its copy is younger than `index_max_age_s`; else one GET.

    A miss is a cache created a moment ago, or a replica whose watch never ran. An old copy
    may be stale: kopf stops the watches of a replica that peering pauses (a standby), so its
    index keeps whatever it held when it stopped being the leader. Re-reading old copies bounds
    how stale an answer can be on any replica, at one GET per cache and period on the leader.
    """
    key = (namespace, name)
    store = index.get(key) if index is not None else None
    indexed = next(iter(store)) if store else None
    now = time.monotonic()
    max_age = state.config.index_max_age_s
    for copy in (indexed, state.refreshed.get(key)):
        if copy is not None and now - copy.at <= max_age:
            return copy
    if state.api is None:
        return indexed
    path = f"/apis/{C.GROUP}/{C.VERSION}/namespaces/{namespace}/{C.PLURAL}/{name}"
    try:
        obj = await asyncio.wait_for(state.api.get(path), LOOKUP_TIMEOUT_S)
    except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as exc:
        logger.warning("looking up WeightCache %s/%s failed: %s", namespace, name, exc)
        return indexed or state.refreshed.get(key)  # an old copy beats skipping injection
    if not obj:
        state.refreshed.pop(key, None)
        return None
    fresh = _indexed(obj)
    if len(state.refreshed) >= MAX_REFRESHED:
        state.refreshed.clear()
    state.refreshed[key] = fresh
    return fresh


async def _post_event(state: _State, ref: dict[str, str], reason: str, message: str) -> None:
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
        await state.api.create(events.events_path(ref["namespace"]), body)
    except Exception as exc:  # an event is best effort; admission already answered
        logger.warning("posting event on WeightCache %s failed: %s", ref.get("name"), exc)


def _maybe_event(
    state: _State, cache: IndexedCache, pod: dict[str, Any], mismatches: list[str]
) -> None:
    if state.api is None or not mismatches or len(state.tasks) >= MAX_PENDING_EVENTS:
        return  # an API server that does not take events must not pile up tasks here
    now = time.monotonic()
    message = f"{_pod_label(pod)}: " + "; ".join(mismatches)
    key = (cache.ref["namespace"], cache.ref["name"], "; ".join(mismatches))
    last = state.events_sent.get(key)
    if last is not None and now - last < state.config.event_dedupe_s:
        return
    if len(state.events_sent) > 1000:  # bounded: forget the oldest half
        for k in sorted(state.events_sent, key=state.events_sent.__getitem__)[:500]:
            del state.events_sent[k]
    state.events_sent[key] = now
    state.spawn(_post_event(state, cache.ref, "EngineMismatch", message))


def _hand_over(patch: Any, res: mutate.Result) -> None:
    """Give kopf the JSON patch that `mutate.inject` computed.

    kopf answers with `patch.as_json_patch()`, which diffs the whole pod with jsonpatch's
    generic algorithm: several milliseconds per pod, most of an admission's time. The ops
    are known already, so this patch object returns them directly. Should a kopf release
    make that attribute read-only, the diffing route (`patch.fns`) gives the same result.
    """
    ops = res.ops
    try:
        patch.as_json_patch = lambda body=None: list(ops)
    except AttributeError:
        new = res.pod

        def replace(body: dict[str, Any]) -> None:
            body.clear()
            body.update(new)

        patch.fns.append(replace)


def register(
    registry: kopf.OperatorRegistry | None = None,
    config: AdmissionConfig | None = None,
    *,
    api: Any = None,
) -> None:
    """Install the admission handlers and the webhook server set-up on `registry`.

    `api`: an object with async get/create/patch by path (`weightcache.operator.kube.Kube`);
    by default one is built from the service account or kubeconfig at startup.
    """
    registry = registry if registry is not None else kopf.get_default_registry()
    config = config or AdmissionConfig()
    if not config.enabled:
        return
    state = _State(config=config, api=api)

    @kopf.index(C.GROUP, C.VERSION, C.PLURAL, id=INDEX_ID, registry=registry)
    async def weightcache_admission_caches(body: Any, namespace: str, name: str, **_: Any) -> Any:
        return {(namespace, name): _indexed(body)}

    @kopf.on.mutate(
        "v1",
        "pods",
        id=MUTATE_ID,
        operations=["CREATE"],
        ignore_failures=True,
        side_effects=True,
        annotations={C.ANN_CACHE: kopf.PRESENT},
        registry=registry,
    )
    async def inject_pod(
        body: Any, patch: Any, warnings: list[str], dryrun: bool, **kwargs: Any
    ) -> None:
        started = time.perf_counter()
        result = "error"
        try:
            pod: dict[str, Any] = dict(body)
            meta = pod.get("metadata") or {}
            name = (meta.get("annotations") or {}).get(C.ANN_CACHE, "")
            cache = await _lookup(state, kwargs.get(INDEX_ID), meta.get("namespace", ""), name)
            try:
                res = mutate.inject(pod, cache.view if cache else None)
            except mutate.Denied as exc:
                result = "denied"
                raise kopf.AdmissionError(str(exc), code=403) from None
            warnings.extend(res.warnings)
            if cache is not None:
                warnings.extend(
                    podsecurity.engine_warnings(
                        cache.pod_security, cache.view.runtime, cache.view.namespace
                    )
                )
            if cache is None:
                result = "unknown_cache"
            elif res.ops:
                _hand_over(patch, res)
                result = "injected"
            else:
                result = "unchanged"
            if cache is not None and not dryrun:
                _maybe_event(state, cache, pod, res.mismatches)
        except kopf.AdmissionError:
            raise
        except Exception as exc:
            # A bug here must not block pods (the same promise as failurePolicy Ignore):
            # admit unchanged, say so, and count it.
            logger.exception("injection failed; admitting the pod unchanged")
            warnings.append(f"weightcache webhook failed ({exc}); the pod is admitted unchanged")
        finally:
            metrics.REQUESTS.labels(MUTATE_ID, result).inc()
            metrics.DURATION.labels(MUTATE_ID).observe(time.perf_counter() - started)

    @kopf.on.validate(
        C.GROUP,
        C.VERSION,
        C.PLURAL,
        id=VALIDATE_ID,
        operations=["CREATE", "UPDATE"],
        ignore_failures=True,
        registry=registry,
    )
    async def validate_weightcache(
        body: Any, old: Any, operation: str, warnings: list[str], **_: Any
    ) -> None:
        started = time.perf_counter()
        result = "error"
        try:
            raw_old = dict(old) if old is not None else None
            problems = validate.review(operation, dict(body), raw_old)
            if problems:
                result = "denied"
                raise kopf.AdmissionError(validate.denial_message(problems), code=422)
            result = "allowed"
        except kopf.AdmissionError:
            raise
        except Exception as exc:  # the operator reports what it cannot place; do not block
            logger.exception("WeightCache validation failed; admitting it")
            warnings.append(f"weightcache validation failed ({exc}); admitted unvalidated")
        finally:
            metrics.REQUESTS.labels(VALIDATE_ID, result).inc()
            metrics.DURATION.labels(VALIDATE_ID).observe(time.perf_counter() - started)

    @kopf.on.startup(id="weightcache-admission", registry=registry)
    async def start_admission(settings: kopf.OperatorSettings, **_: Any) -> None:
        try:
            if state.api is None:
                state.api = Kube.connect()
            await keeper.run_once(config, state.api)
        except Exception as exc:
            raise kopf.TemporaryError(f"webhook certificates not ready: {exc}", delay=5) from exc
        cert_dir = Path(config.cert_dir)
        cafile = cert_dir / "ca.crt"
        settings.admission.managed = None  # the keeper writes the configurations
        settings.admission.server = kopf.WebhookServer(
            addr=config.addr,
            port=config.port,
            certfile=str(cert_dir / "tls.crt"),
            pkeyfile=str(cert_dir / "tls.key"),
            cafile=str(cafile) if cafile.exists() else None,
            file_check_interval=config.reload_interval_s,
        )

        async def later() -> None:
            await asyncio.sleep(config.check_interval_s)
            await keeper.keep(config, state.api)

        state.spawn(later())

    @kopf.on.cleanup(id="weightcache-admission-cleanup", registry=registry)
    async def stop_admission(**_: Any) -> None:
        for task in list(state.tasks):
            task.cancel()
        if isinstance(state.api, Kube):
            await state.api.close()
