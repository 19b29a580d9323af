"""The OpenAPI v3 schema of the WeightCache spec, generated from the typed API.

Each field's metadata (`v1alpha1.prop`) says its type, description, bounds and enum, and a
constant default becomes the schema's `default:`. The API server applies a structural
schema's defaults when it decodes an object (also on reads from etcd), only where the parent
object is present, and prunes and validates the defaulted object like any other (Kubernetes
docs, "Extend the Kubernetes API with CustomResourceDefinitions", section "Defaulting"), so a
default written here must itself satisfy its schema: `weightcache.testing.apirules` checks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec, camel

FREE = "x-kubernetes-preserve-unknown-fields"


def _free(description: str) -> dict[str, Any]:
    """A core/v1 type kept verbatim (validated by the API server where it is used)."""
    return {"type": "object", "description": description, FREE: True}


def _items(items: Any) -> dict[str, Any]:
    kind, detail = items if isinstance(items, tuple) else (items, None)
    if kind == "free":
        return _free(detail or "")
    out: dict[str, Any] = {"type": kind}
    if detail:
        out["pattern"] = detail
    return out


def field_schema(f: dataclasses.Field) -> dict[str, Any]:
    meta = f.metadata
    nested = meta.get("class")
    if nested is not None:
        return object_schema(nested)
    kind, description = meta["kind"], meta["description"]
    if kind == "free":
        return _free(description)
    if kind == "labels":
        return {"type": "object", "description": description,
                "additionalProperties": {"type": "string"}}
    out: dict[str, Any] = {"type": kind, "description": description}
    if kind == "array":
        out["items"] = _items(meta["items"])
    out.update(meta["schema"])
    if meta["schema_default"]:
        out["default"] = f.default if meta["implied"] is None else meta["implied"]
    return out


def object_schema(cls: type) -> dict[str, Any]:
    """The schema of one API class: its fields' schemas, required fields and CEL rules."""
    properties = {
        camel(f.name): field_schema(f)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name != "malformed"
    }
    out: dict[str, Any] = {"type": "object", "description": cls.DESCRIPTION,  # type: ignore[attr-defined]
                           "properties": properties}
    if cls.VALIDATIONS:  # type: ignore[attr-defined]
        out["x-kubernetes-validations"] = [dict(v) for v in cls.VALIDATIONS]  # type: ignore[attr-defined]
    if cls.REQUIRED:  # type: ignore[attr-defined]
        out["required"] = list(cls.REQUIRED)  # type: ignore[attr-defined]
    return out


def spec_schema() -> dict[str, Any]:
    """The `spec` schema of the CRD."""
    return object_schema(WeightCacheSpec)
