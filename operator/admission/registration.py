"""How the admission handlers are installed on kopf, and one workaround for kopf's patch.

`register` puts on a kopf registry: the index of WeightCaches (`lookup`), the mutating
handler (decisions in `inject`, events in `notify`), the validating handler (`validate`),
and a startup activity that prepares certificates (`keeper`), hands kopf a `WebhookServer`
and keeps the webhook configurations current. Errors in a handler admit the pod unchanged,
the same promise as the configuration's failurePolicy Ignore.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from weightcache import constants as C
from weightcache.operator.admission import inject, keeper, metrics, podsecurity, validate
from weightcache.operator.admission.config import (
    INDEX_ID,
    MUTATE_ID,
    VALIDATE_ID,
    AdmissionConfig,
)
from weightcache.operator.admission.lookup import CacheLookup, indexed
from weightcache.operator.admission.notify import Notifier
from weightcache.operator.kube import Kube

logger = logging.getLogger(__name__)


@dataclass
class _State:
    lookup: CacheLookup
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def api(self) -> Any:
        return self.lookup.api

    @api.setter
    def api(self, value: Any) -> None:
        self.lookup.api = value

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _hand_over(patch: Any, res: inject.Result) -> None:
    """Give kopf the JSON patch that `inject.inject` computed.

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
    state = _State(lookup=CacheLookup(config=config, api=api))
    notifier = Notifier(
        config=config,
        api=lambda: state.api,
        spawn=state.spawn,
        pending=lambda: len(state.tasks),
    )

    @kopf.index(C.GROUP, C.VERSION, C.PLURAL, id=INDEX_ID, registry=registry)
    async def weightcache_admission_caches(body: Any, namespace: str, name: str, **_: Any) -> Any:
        return {(namespace, name): indexed(body)}

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
            cache = await state.lookup(kwargs.get(INDEX_ID), meta.get("namespace", ""), name)
            try:
                res = inject.inject(pod, cache.view if cache else None)
            except inject.Denied as exc:
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
                notifier.mismatches(cache, pod, res.mismatches)
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
