"""Admission settings, and the webhook configuration objects built from them.

kopf can manage webhook configurations itself, but the ones it writes fix the timeout at
30 s and carry neither a namespace selector nor match conditions. An engine pod's
creation must never wait on the operator, and pods that did not opt in should never
reach it, so the operator writes both configurations itself (see `keeper.py`).
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from weightcache import constants as C

MUTATE_ID = "inject-pod"
VALIDATE_ID = "validate-weightcache"
INDEX_ID = "weightcache_admission_caches"
CERT_MODES = ("self-signed", "cert-manager")
OPERATOR_APP = "weightcache-operator"


def _env_namespace() -> str:
    return (
        os.environ.get("POD_NAMESPACE")
        or os.environ.get("WEIGHTCACHE_OPERATOR_NAMESPACE")
        or ("weightcache-system")
    )


@dataclass
class AdmissionConfig:
    """How the webhooks are served and published. Defaults match the Helm chart."""

    enabled: bool = True
    namespace: str = field(default_factory=_env_namespace)  # the operator's namespace
    service_name: str = "weightcache-webhook"  # Service in front of all operator replicas
    service_port: int = 443
    addr: str = "0.0.0.0"
    port: int = 9443
    url: str | None = None  # clientConfig.url instead of the Service (out-of-cluster runs)
    cert_mode: str = "self-signed"
    cert_dir: str = "/tmp/weightcache-webhook"  # self-signed: written here; cert-manager: mounted
    secret_name: str = "weightcache-webhook-tls"
    extra_sans: tuple[str, ...] = ()
    rotate_before_days: float = 30.0
    check_interval_s: float = 3600.0  # how often the keeper re-checks certificate and configs
    reload_interval_s: float = 10.0  # how often kopf's server re-reads the certificate files
    manage_configurations: bool = True
    configuration_name: str = "weightcache"
    timeout_seconds: int = 5
    failure_policy: str = "Ignore"
    excluded_namespaces: tuple[str, ...] = ("kube-system",)
    event_dedupe_s: float = 300.0  # one mismatch event per cache and message in this window
    index_max_age_s: float = 60.0  # older index copies of a cache are re-read (standbys)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdmissionConfig:
        return cls(
            enabled=not args.webhook_disabled,
            namespace=args.webhook_namespace or _env_namespace(),
            service_name=args.webhook_service,
            addr=args.webhook_addr,
            port=args.webhook_port,
            url=args.webhook_url,
            cert_mode=args.webhook_cert_mode,
            cert_dir=args.webhook_cert_dir,
            secret_name=args.webhook_secret,
            manage_configurations=not args.webhook_unmanaged,
            configuration_name=args.webhook_configuration,
            timeout_seconds=args.webhook_timeout,
            failure_policy=args.webhook_failure_policy,
            index_max_age_s=args.webhook_index_max_age,
        )

    def dns_names(self) -> list[str]:
        from weightcache.operator.admission.certs import service_names

        names = [*service_names(self.service_name, self.namespace), *self.extra_sans]
        host = urllib.parse.urlsplit(self.url).hostname if self.url else None
        if host and host not in names:
            names.append(host)  # out-of-cluster runs: the published URL must verify too
        return names

    def client_config(self, path: str, ca_bundle: str | None) -> dict[str, Any]:
        cfg: dict[str, Any]
        if self.url:
            cfg = {"url": f"{self.url.rstrip('/')}/{path}"}
        else:
            cfg = {
                "service": {
                    "name": self.service_name,
                    "namespace": self.namespace,
                    "path": f"/{path}",
                    "port": self.service_port,
                }
            }
        if ca_bundle:
            cfg["caBundle"] = ca_bundle
        return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AdmissionConfig(namespace="")
    g = parser.add_argument_group("admission webhooks")
    g.add_argument("--webhook-disabled", action="store_true", help="serve no webhooks")
    g.add_argument("--webhook-namespace", default=None, help="operator namespace ($POD_NAMESPACE)")
    g.add_argument("--webhook-service", default=d.service_name, help="webhook Service name")
    g.add_argument("--webhook-addr", default=d.addr, help="listen address")
    g.add_argument("--webhook-port", type=int, default=d.port, help="listen port")
    g.add_argument("--webhook-url", default=None, help="publish this URL instead of the Service")
    g.add_argument("--webhook-cert-mode", choices=CERT_MODES, default=d.cert_mode)
    g.add_argument("--webhook-cert-dir", default=d.cert_dir, help="certificate files directory")
    g.add_argument("--webhook-secret", default=d.secret_name, help="Secret for self-signed certs")
    g.add_argument(
        "--webhook-unmanaged",
        action="store_true",
        help="do not write the webhook configurations (the chart or cert-manager owns them)",
    )
    g.add_argument("--webhook-configuration", default=d.configuration_name)
    g.add_argument("--webhook-timeout", type=int, default=d.timeout_seconds)
    g.add_argument("--webhook-failure-policy", choices=("Ignore", "Fail"), default="Ignore")
    g.add_argument(
        "--webhook-index-max-age",
        type=float,
        default=d.index_max_age_s,
        help="seconds after which a cache's indexed copy is re-read before use (bounds how "
        "stale a standby replica's answers can be)",
    )


def _namespace_selector(config: AdmissionConfig) -> dict[str, Any]:
    excluded = sorted({*config.excluded_namespaces, config.namespace})
    return {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded},
            {"key": f"{C.GROUP}/admission", "operator": "NotIn", "values": ["disabled"]},
        ]
    }


def mutating_configuration(config: AdmissionConfig, ca_bundle: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": config.configuration_name,
            "labels": {C.LABEL_APP: OPERATOR_APP},
        },
        "webhooks": [
            {
                "name": f"{MUTATE_ID}.{C.GROUP}",
                "admissionReviewVersions": ["v1"],
                "clientConfig": config.client_config(MUTATE_ID, ca_bundle),
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                        "scope": "Namespaced",
                    }
                ],
                "failurePolicy": config.failure_policy,
                "matchPolicy": "Equivalent",
                "sideEffects": "NoneOnDryRun",  # mismatch events are skipped on dry runs
                "timeoutSeconds": config.timeout_seconds,
                "reinvocationPolicy": "IfNeeded",
                "namespaceSelector": _namespace_selector(config),
                "objectSelector": {
                    "matchExpressions": [
                        {
                            "key": C.LABEL_APP,
                            "operator": "NotIn",
                            "values": [C.AGENT_APP, OPERATOR_APP],
                        }
                    ]
                },
                # Only pods carrying the opt-in annotation are sent at all (CEL, GA in 1.30).
                "matchConditions": [
                    {
                        "name": "opted-in",
                        "expression": (
                            "has(object.metadata.annotations) && "
                            f"'{C.ANN_CACHE}' in object.metadata.annotations"
                        ),
                    }
                ],
            }
        ],
    }


def validating_configuration(config: AdmissionConfig, ca_bundle: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": config.configuration_name,
            "labels": {C.LABEL_APP: OPERATOR_APP},
        },
        "webhooks": [
            {
                "name": f"{VALIDATE_ID}.{C.GROUP}",
                "admissionReviewVersions": ["v1"],
                "clientConfig": config.client_config(VALIDATE_ID, ca_bundle),
                "rules": [
                    {
                        "apiGroups": [C.GROUP],
                        "apiVersions": [C.VERSION],
                        "resources": [C.PLURAL],
                        "operations": ["CREATE", "UPDATE"],
                        "scope": "Namespaced",
                    }
                ],
                "failurePolicy": config.failure_policy,
                "matchPolicy": "Equivalent",
                "sideEffects": "None",
                "timeoutSeconds": config.timeout_seconds,
            }
        ],
    }
