"""Webhook metrics (docs/interfaces.md, "Metrics"), on prometheus_client's default registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "weightcache_webhook_requests_total",
    "Admission requests answered by the weightcache webhooks, by webhook and result.",
    ["webhook", "result"],
)
DURATION = Histogram(
    "weightcache_webhook_duration_seconds",
    "Time spent deciding one admission request, by webhook.",
    ["webhook"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
CERT_EXPIRY = Gauge(
    "weightcache_webhook_certificate_expiry_timestamp_seconds",
    "Expiry of the certificate the webhook server presents (Unix time).",
)
