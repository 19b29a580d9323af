"""The webhook's serving certificate: issue, store in a Secret, rotate, publish the CA.

The API server only calls webhooks over HTTPS it can verify, so the operator needs a CA
the API server trusts (the `caBundle` of the webhook configurations) and a serving
certificate for the webhook Service's DNS names. Two modes:

* `self-signed`: the operator keeps a CA and a serving certificate in one Secret (so all
  replicas serve the same certificate), re-issues the serving certificate before it
  expires, and replaces the CA before it expires while the old CA stays in the bundle;
* `cert-manager`: cert-manager writes the Secret; the operator only reads the mounted
  files (kopf's server reloads them when they change) and publishes `ca.crt`.

kopf's own self-signing needs certbuilder/oscrypto, which fail on OpenSSL 3, hence
`cryptography`. Keys are ECDSA P-256: small, fast handshakes, accepted by the API server.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVING_DAYS = 365
ROTATE_BEFORE = dt.timedelta(days=30)
KEYS = ("tls.crt", "tls.key", "ca.crt")
CA_KEY = "ca.key"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the API server may use for a Service-backed webhook."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(
    common_name: str = "weightcache-webhook-ca", days: int = CA_DAYS, now: dt.datetime | None = None
) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, key PEM)."""
    now = now or _now()
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(
    ca_crt: bytes,
    ca_key: bytes,
    names: list[str],
    days: int = SERVING_DAYS,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A serving certificate for `names` (DNS names or IPs) signed by the CA."""
    now = now or _now()
    ca = x509.load_pem_x509_certificate(ca_crt)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = _key()
    not_after = min(now + dt.timedelta(days=days), ca.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def not_after(pem: bytes) -> dt.datetime:
    """Expiry of the first certificate in a PEM blob."""
    return x509.load_pem_x509_certificates(pem)[0].not_valid_after_utc


def _sans(pem: bytes) -> set[str]:
    cert = x509.load_pem_x509_certificates(pem)[0]
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in ext.get_values_for_type(x509.DNSName)} | {
        str(v) for v in ext.get_values_for_type(x509.IPAddress)
    }


@dataclass(frozen=True)
class Bundle:
    """PEM material as kept in the Secret. `ca_crt` may hold several CAs during a CA change."""

    tls_crt: bytes
    tls_key: bytes
    ca_crt: bytes
    ca_key: bytes | None = None

    @property
    def expires(self) -> dt.datetime:
        return not_after(self.tls_crt)

    def secret_data(self) -> dict[str, str]:
        data = {"tls.crt": self.tls_crt, "tls.key": self.tls_key, "ca.crt": self.ca_crt}
        if self.ca_key is not None:
            data[CA_KEY] = self.ca_key
        return {k: base64.b64encode(v).decode() for k, v in data.items()}

    @classmethod
    def from_secret(cls, secret: dict[str, Any]) -> Bundle | None:
        data = secret.get("data") or {}
        if not all(k in data for k in KEYS):
            return None
        raw = {k: base64.b64decode(v) for k, v in data.items()}
        return cls(raw["tls.crt"], raw["tls.key"], raw["ca.crt"], raw.get(CA_KEY))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> Bundle:
        d = Path(directory)
        ca = d / "ca.crt"
        return cls(
            (d / "tls.crt").read_bytes(),
            (d / "tls.key").read_bytes(),
            ca.read_bytes() if ca.exists() else (d / "tls.crt").read_bytes(),
        )

    def write(self, directory: str | os.PathLike[str]) -> bool:
        """Write tls.crt/tls.key/ca.crt atomically; True if anything changed on disk."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        changed = False
        for name, content in (
            ("tls.crt", self.tls_crt),
            ("tls.key", self.tls_key),
            ("ca.crt", self.ca_crt),
        ):
            path = d / name
            if path.exists() and path.read_bytes() == content:
                continue
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
            changed = True
        return changed


def fresh(names: list[str], now: dt.datetime | None = None) -> Bundle:
    ca_crt, ca_key = make_ca(now=now)
    crt, key = issue(ca_crt, ca_key, names, now=now)
    return Bundle(crt, key, ca_crt, ca_key)


def renew(
    current: Bundle | None,
    names: list[str],
    now: dt.datetime | None = None,
    before: dt.timedelta = ROTATE_BEFORE,
) -> Bundle | None:
    """The bundle to store instead of `current`, or None when `current` is still good.

    The serving certificate is re-issued when it nears expiry or lacks a name. The CA is
    replaced when it nears expiry; the outgoing CA stays in `ca.crt` (the caBundle) until
    it expires, so API servers holding either bundle keep trusting the webhook.
    """
    now = now or _now()
    if current is None or not current.ca_key:
        return fresh(names, now)
    cas = x509.load_pem_x509_certificates(current.ca_crt)
    signing_ca = cas[0]
    ca_crt, ca_key = signing_ca.public_bytes(serialization.Encoding.PEM), current.ca_key
    extra: list[bytes] = []
    if signing_ca.not_valid_after_utc - now < before:
        ca_crt, ca_key = make_ca(now=now)
        extra = [signing_ca.public_bytes(serialization.Encoding.PEM)]
    elif (
        current.expires - now >= before
        and set(names) <= _sans(current.tls_crt)
        and _signed_by(current.tls_crt, signing_ca)
    ):
        return None
    crt, key = issue(ca_crt, ca_key, names, now=now)
    alive = [
        c.public_bytes(serialization.Encoding.PEM) for c in cas[1:] if c.not_valid_after_utc > now
    ]
    return Bundle(crt, key, b"".join([ca_crt, *extra, *alive]), ca_key)


def _signed_by(crt_pem: bytes, ca: x509.Certificate) -> bool:
    cert = x509.load_pem_x509_certificates(crt_pem)[0]
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception):
        return False
    return True


class SecretStore(Protocol):
    """The API calls the self-signed mode needs (`weightcache.operator.kube.Kube` has them)."""

    async def get(self, path: str) -> dict[str, Any] | None: ...
    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...
    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...


async def ensure_secret(
    api: SecretStore,
    namespace: str,
    name: str,
    names: list[str],
    now: dt.datetime | None = None,
    before: dt.timedelta = ROTATE_BEFORE,
) -> Bundle:
    """Read the Secret, renew what needs renewing, write it back; return what to serve."""
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    secret = await api.get(path)
    try:
        current = Bundle.from_secret(secret) if secret else None
        updated = renew(current, names, now=now, before=before)
    except (ValueError, TypeError):  # empty placeholders (a chart's pre-created Secret), junk
        current, updated = None, fresh(names, now)
    if updated is None:
        assert current is not None
        return current
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "weightcache-operator"},
        },
        "type": "kubernetes.io/tls",
        "data": updated.secret_data(),
    }
    if secret is None:
        await api.create(f"/api/v1/namespaces/{namespace}/secrets", body)
    else:
        await api.patch(path, {"data": body["data"]})
    return updated


def ca_bundle_b64(bundle: Bundle) -> str:
    return base64.b64encode(bundle.ca_crt).decode()
