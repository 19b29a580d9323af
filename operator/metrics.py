"""Operator metrics (names fixed in docs/interfaces.md) and the /metrics + /healthz server.

The reconciler's series live in a registry of their own (tests run several operators in one
interpreter); /metrics serves them together with the default registry, where the admission
webhooks keep theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

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
        self.nodes = Gauge(
            "weightcache_operator_nodes",
            "Nodes the operator has seen (placement candidates before filtering).",
            registry=self.registry,
        )

    def set_phases(self, phases: Counter[str]) -> None:
        for phase in PHASES:
            self.caches.labels(phase=phase).set(phases.get(phase, 0))

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
