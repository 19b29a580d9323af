"""Partial OpenAPI schemas of the third-party kinds the chart renders.

The Prometheus Operator's and cert-manager's CRDs are not available offline, so these
schemas cover the fields the chart uses, with the types and enums of those projects'
v1 APIs; unknown fields are rejected so a misspelt key fails here rather than in a cluster.
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string"}
_STRMAP = {"type": "object", "additionalProperties": _STR}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRMAP,
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$",
}
_NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": _STR,
        "path": _STR,
        "interval": _DURATION,
        "scheme": {"enum": ["http", "https"]},
    },
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "properties": {
        "alert": _STR,
        "record": _STR,
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "labels": _STRMAP,
        "annotations": _STRMAP,
    },
}


def _spec(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": required,
                "properties": properties,
            }
        },
    }


SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _spec(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _NS_SELECTOR,
            "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
        },
        ["selector", "endpoints"],
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _spec(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _NS_SELECTOR,
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
        },
        ["selector", "podMetricsEndpoints"],
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _spec(
        {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {
                        "name": _STR,
                        "interval": _DURATION,
                        "rules": {"type": "array", "items": _RULE},
                    },
                },
            }
        },
        ["groups"],
    ),
    ("cert-manager.io/v1", "Issuer"): _spec(
        {"selfSigned": {"type": "object"}, "ca": {"type": "object"}, "acme": {"type": "object"}},
        [],
    ),
    ("cert-manager.io/v1", "Certificate"): _spec(
        {
            "secretName": {"type": "string", "minLength": 1},
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": {"type": "array", "items": _STR},
            "duration": _STR,
            "renewBefore": _STR,
            "privateKey": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                },
            },
            "issuerRef": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": _STR, "kind": _STR, "group": _STR},
            },
        },
        ["secretName", "issuerRef"],
    ),
}
