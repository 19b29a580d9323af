"""Keeps the served certificate and the published caBundle current.

One pass: get the certificate material (from the Secret, renewing it when due, or from
cert-manager's mounted files), write it where kopf's WebhookServer reads it (the server
reloads when the files change), and write both webhook configurations with the CA
bundle. The operator runs one pass at startup, before the server starts, then one every
`check_interval_s`: rotation happens long before expiry, so an hourly check is plenty.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

from weightcache.operator.admission import certs, metrics
from weightcache.operator.admission.config import (
    AdmissionConfig,
    mutating_configuration,
    validating_configuration,
)
from weightcache.operator.kube import ApiError

logger = logging.getLogger(__name__)

_ADMISSION_API = "/apis/admissionregistration.k8s.io/v1"
PATHS = {
    "MutatingWebhookConfiguration": f"{_ADMISSION_API}/mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": f"{_ADMISSION_API}/validatingwebhookconfigurations",
}


async def current_bundle(
    config: AdmissionConfig, api: certs.SecretStore, now: dt.datetime | None = None
) -> certs.Bundle:
    if config.cert_mode == "cert-manager":
        return certs.Bundle.from_dir(config.cert_dir)
    before = dt.timedelta(days=config.rotate_before_days)
    try:
        bundle = await certs.ensure_secret(
            api, config.namespace, config.secret_name, config.dns_names(), now=now, before=before
        )
    except ApiError as exc:
        if exc.status != 409:  # another replica created it first: use theirs
            raise
        bundle = await certs.ensure_secret(
            api, config.namespace, config.secret_name, config.dns_names(), now=now, before=before
        )
    bundle.write(config.cert_dir)
    return bundle


async def apply(api: certs.SecretStore, body: dict[str, Any]) -> None:
    """Create the configuration, or merge-patch its webhooks (a list: replaced whole)."""
    base = PATHS[body["kind"]]
    name = body["metadata"]["name"]
    existing = await api.get(f"{base}/{name}")
    if existing is None:
        try:
            await api.create(base, body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise
    if existing is not None and existing.get("webhooks") == body["webhooks"]:
        return
    await api.patch(
        f"{base}/{name}",
        {"metadata": {"labels": body["metadata"]["labels"]}, "webhooks": body["webhooks"]},
    )


async def run_once(
    config: AdmissionConfig, api: certs.SecretStore, now: dt.datetime | None = None
) -> certs.Bundle:
    bundle = await current_bundle(config, api, now=now)
    metrics.CERT_EXPIRY.set(bundle.expires.timestamp())
    if config.manage_configurations:
        ca = certs.ca_bundle_b64(bundle)
        await apply(api, mutating_configuration(config, ca))
        await apply(api, validating_configuration(config, ca))
    return bundle


async def keep(config: AdmissionConfig, api: certs.SecretStore) -> None:
    """Run passes forever; errors are logged and retried on a shorter interval."""
    while True:
        delay = config.check_interval_s
        try:
            await run_once(config, api)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("webhook certificate/configuration pass failed: %s", exc)
            delay = min(delay, 30.0)
        await asyncio.sleep(delay)
