"""Certificates: issue, rotate before expiry, CA overlap, Secret, hot reload, cert-manager."""

from __future__ import annotations

import base64
import datetime as dt
import json
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509

from weightcache.operator.admission import certs
from weightcache.testing.webhook import NAMESPACE, LocalWebhook, review_request

NAMES = certs.service_names("weightcache-webhook", "weightcache-system")
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def load(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem)


def sans(pem: bytes) -> list[str]:
    ext = load(pem)[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + [
        str(v) for v in ext.get_values_for_type(x509.IPAddress)
    ]


def test_fresh_bundle_is_a_valid_chain() -> None:
    b = certs.fresh([*NAMES, "127.0.0.1"], now=NOW)
    leaf, (ca,) = load(b.tls_crt)[0], load(b.ca_crt)
    leaf.verify_directly_issued_by(ca)
    assert sans(b.tls_crt) == [*NAMES, "127.0.0.1"]
    assert leaf.not_valid_after_utc - NOW == dt.timedelta(days=certs.SERVING_DAYS)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


def test_renew_keeps_a_good_bundle() -> None:
    b = certs.fresh(NAMES, now=NOW)
    assert certs.renew(b, NAMES, now=NOW + dt.timedelta(days=300)) is None


def test_serving_cert_rotates_before_expiry_with_the_same_ca() -> None:
    b = certs.fresh(NAMES, now=NOW)
    later = NOW + dt.timedelta(days=certs.SERVING_DAYS - 10)
    r = certs.renew(b, NAMES, now=later)
    assert r is not None
    assert r.ca_crt == b.ca_crt and r.ca_key == b.ca_key
    assert r.expires - later == dt.timedelta(days=certs.SERVING_DAYS)
    load(r.tls_crt)[0].verify_directly_issued_by(load(b.ca_crt)[0])


def test_new_service_name_reissues() -> None:
    b = certs.fresh(NAMES, now=NOW)
    r = certs.renew(b, [*NAMES, "webhook.example"], now=NOW)
    assert r is not None and "webhook.example" in sans(r.tls_crt)


def test_ca_rotation_keeps_the_old_ca_in_the_bundle() -> None:
    b = certs.fresh(NAMES, now=NOW)
    near_ca_end = NOW + dt.timedelta(days=certs.CA_DAYS - 5)
    r = certs.renew(b, NAMES, now=near_ca_end)
    assert r is not None
    new_ca, old_ca = load(r.ca_crt)
    assert old_ca.serial_number == load(b.ca_crt)[0].serial_number
    load(r.tls_crt)[0].verify_directly_issued_by(new_ca)
    # Once the old CA has expired it leaves the bundle.
    again = certs.renew(r, [*NAMES, "x.example"], now=near_ca_end + dt.timedelta(days=10))
    assert again is not None and len(load(again.ca_crt)) == 1


def test_secret_roundtrip_and_files(tmp_path: Path) -> None:
    b = certs.fresh(NAMES, now=NOW)
    secret = {"data": b.secret_data()}
    assert certs.Bundle.from_secret(secret) == b
    assert b.write(tmp_path) is True
    assert b.write(tmp_path) is False  # unchanged: no rewrite, no server reload
    assert (tmp_path / "tls.key").stat().st_mode & 0o777 == 0o600
    assert certs.Bundle.from_dir(tmp_path).tls_crt == b.tls_crt


def test_keeper_stores_secret_and_publishes_ca_bundle(webhook: LocalWebhook) -> None:
    secret = webhook.call(
        webhook.api.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/weightcache-webhook-tls")
    )
    assert secret["type"] == "kubernetes.io/tls"
    stored = certs.Bundle.from_secret(secret)
    assert stored is not None and stored.ca_key is not None
    assert stored.tls_crt == (webhook.cert_dir / "tls.crt").read_bytes()
    ca_b64 = base64.b64encode(stored.ca_crt).decode()
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        cfg = webhook.call(
            webhook.api.get(f"/apis/admissionregistration.k8s.io/v1/{kind}/weightcache")
        )
        (hook,) = cfg["webhooks"]
        assert hook["clientConfig"]["caBundle"] == ca_b64
        assert hook["clientConfig"]["url"].startswith(webhook.url)
        assert hook["failurePolicy"] == "Ignore"
        assert hook["timeoutSeconds"] == 5
    assert webhook.ssl is not None  # the tests' HTTPS client verifies against exactly this CA


def _served_serial(hook: LocalWebhook, ctx: ssl.SSLContext) -> int:
    body = json.dumps(review_request(None, operation="DELETE", old={"metadata": {}})).encode()
    req = urllib.request.Request(
        f"{hook.url}/inject-pod",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
        der = resp.fp.raw._sock.getpeercert(binary_form=True)  # type: ignore[attr-defined]
    return x509.load_der_x509_certificate(der).serial_number


def test_rotation_is_picked_up_without_restart(tmp_path: Path) -> None:
    """A renewed Secret reaches the files; kopf's server reloads them and serves the new cert."""
    with LocalWebhook(cert_dir=tmp_path) as hook:
        assert hook.ssl is not None
        first = _served_serial(hook, hook.ssl)
        # Pretend the certificate is within the rotation window: one keeper pass renews it.
        from weightcache.operator.admission import keeper

        hook.config.rotate_before_days = certs.SERVING_DAYS + 1
        bundle = hook.call(keeper.run_once(hook.config, hook.api))
        assert load(bundle.tls_crt)[0].serial_number != first
        deadline = time.monotonic() + 10
        serial = first
        while time.monotonic() < deadline and serial == first:
            time.sleep(0.2)
            try:
                serial = _served_serial(hook, hook.ssl)
            except OSError:
                continue  # the server restarts its listener
        assert serial == load(bundle.tls_crt)[0].serial_number


def test_cert_manager_mode_reads_mounted_files(tmp_path: Path) -> None:
    mounted = certs.fresh(["127.0.0.1", "localhost"])
    # cert-manager's Secret has no CA key; the operator must not need one.
    certs.Bundle(mounted.tls_crt, mounted.tls_key, mounted.ca_crt).write(tmp_path)
    with LocalWebhook(cert_dir=tmp_path, cert_mode="cert-manager") as hook:
        assert _served_serial(hook, hook.ssl) == load(mounted.tls_crt)[0].serial_number  # type: ignore[arg-type]
        secret = hook.call(
            hook.api.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/weightcache-webhook-tls")
        )
        assert secret is None  # nothing self-signed was created
        cfg = hook.call(
            hook.api.get(
                "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/weightcache"
            )
        )
        assert (
            cfg["webhooks"][0]["clientConfig"]["caBundle"]
            == base64.b64encode(mounted.ca_crt).decode()
        )


def test_untrusted_client_cannot_talk_to_the_webhook(webhook: LocalWebhook) -> None:
    ctx = ssl.create_default_context()  # system CAs only: the webhook's CA is private
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _served_serial(webhook, ctx)


def test_replicas_racing_on_a_new_secret_end_up_with_one_certificate(webhook: LocalWebhook) -> None:
    import asyncio
    import dataclasses

    from weightcache.operator.admission import keeper

    configs = [
        dataclasses.replace(
            webhook.config,
            secret_name="race-tls",
            cert_dir=str(webhook.cert_dir / f"r{i}"),
            manage_configurations=False,
        )
        for i in range(2)
    ]

    async def both() -> list[certs.Bundle]:
        return list(await asyncio.gather(*(keeper.current_bundle(c, webhook.api) for c in configs)))

    a, b = webhook.call(both())
    assert a.tls_crt == b.tls_crt
    stored = webhook.call(webhook.api.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/race-tls"))
    assert certs.Bundle.from_secret(stored) == a


def test_keeper_repairs_a_stale_ca_bundle(webhook: LocalWebhook) -> None:
    from weightcache.operator.admission import keeper

    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/weightcache"
    good = webhook.call(webhook.api.get(path))["webhooks"]
    stale = [{**good[0], "clientConfig": {**good[0]["clientConfig"], "caBundle": "c3RhbGU="}}]
    webhook.call(webhook.api.patch(path, {"webhooks": stale}))
    webhook.call(keeper.run_once(webhook.config, webhook.api))
    assert webhook.call(webhook.api.get(path))["webhooks"] == good


def test_keeper_fills_a_placeholder_secret_created_by_the_chart(webhook: LocalWebhook) -> None:
    import dataclasses

    from weightcache.operator.admission import keeper

    placeholder = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "chart-tls", "namespace": NAMESPACE},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": "", "tls.key": "", "ca.crt": "", "ca.key": ""},
    }
    webhook.call(webhook.api.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", placeholder))
    cfg = dataclasses.replace(
        webhook.config,
        secret_name="chart-tls",
        cert_dir=str(webhook.cert_dir / "chart"),
        manage_configurations=False,
    )
    bundle = webhook.call(keeper.current_bundle(cfg, webhook.api))
    stored = webhook.call(webhook.api.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/chart-tls"))
    assert certs.Bundle.from_secret(stored) == bundle
    load(bundle.tls_crt)[0].verify_directly_issued_by(load(bundle.ca_crt)[0])
