"""Operator metrics (names fixed in docs/interfaces.md) and the /metrics + /healthz server.

The reconciler's series live in a registry of their own (tests run several operators in one
interpreter); /metrics serves them together with the default registry, where the admission
webhooks keep theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PHASES = (
    "Pending", "Placing", "Loading", "Ready", "Degraded", "Invalid", "Unschedulable", "Failed"
)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = PromCounter(
            "weightcache_operator_reconciles",
            "Reconciliations of WeightCaches by result (ok, error).",
            ["result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "weightcache_operator_reconcile_duration_seconds",
            "Time one reconciliation of a WeightCache took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.caches = Gauge(
            "weightcache_operator_caches",
            "WeightCaches by phase.",
            ["phase"],
            registry=self.registry,
        )
        for phase in PHASES:
            self.caches.labels(phase=phase).set(0)
        # One series per cache (1 for its current phase), so alerts can name the cache.
        self.cache_phase = Gauge(
            "weightcache_cache_phase",
            "Phase of each WeightCache: 1 for the phase it is in.",
            ["namespace", "cache", "phase"],
            registry=self.registry,
        )
        self._cache_phases: dict[tuple[str, str], str] = {}
        self.nodes = Gauge(
            "weightcache_operator_nodes",
            "Nodes the operator has seen (placement candidates before filtering).",
            registry=self.registry,
        )

    def set_phases(self, phases: Counter[str]) -> None:
        for phase in PHASES:
            self.caches.labels(phase=phase).set(phases.get(phase, 0))

    def set_cache_phases(self, phases: Mapping[tuple[str, str], str]) -> None:
        """Per-cache phase series; those of deleted caches or left phases are removed."""
        for key, phase in list(self._cache_phases.items()):
            if phases.get(key) != phase:
                self.cache_phase.remove(key[0], key[1], phase)
                del self._cache_phases[key]
        for (namespace, name), phase in phases.items():
            self.cache_phase.labels(namespace=namespace, cache=name, phase=phase).set(1)
            self._cache_phases[(namespace, name)] = phase

    def render(self) -> bytes:
        """The operator's series plus the process-wide default registry (webhook metrics)."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)


async def serve(
    metrics: OperatorMetrics,
    *,
    host: str,
    port: int,
    healthy: Callable[[], bool] = lambda: True,
) -> web.AppRunner:
    """Serve /metrics and /healthz; returns the runner (call `cleanup()` to stop)."""

    async def metrics_view(_: web.Request) -> web.Response:
        response = web.Response(body=metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def health_view(_: web.Request) -> web.Response:
        ok = healthy()
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", health_view)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
