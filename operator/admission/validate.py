"""Validation of WeightCache create/update: what the CRD schema cannot express.

The semantic rules live in `weightcache.operator.spec.validate`, shared with the operator
(which reports them as an Invalid condition); this module adds what only an admission
review can see: the old object on update, and the name (every derived object name must be
valid). Every denial names the field and the fix.

What is never denied: a validating webhook also sees every metadata-only UPDATE (kopf adding
or removing its finalizer, an admin removing it by hand, labels, annotations) and, when its
rules list the subresource, status writes. Re-validating the spec there would make a cache that
became invalid while the webhook failed open undeletable (its finalizer could never be
removed). So deletion, objects being deleted and every UPDATE that leaves `spec` unchanged are
admitted unconditionally; only a spec change is judged.
"""

from __future__ import annotations

from typing import Any

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator import spec as specs
from weightcache.operator.spec import Problem

# Fields that running engines depend on: changing them in place would strand every engine
# injected against the old value, so the way to change them is a new WeightCache.
IMMUTABLE: dict[str, str] = {
    "runtime": "engines were injected with this runtime's loader settings",
    "socketDir": "running engines mount this host directory",
    "runAs": "running engines run as this uid/gid and the daemon checks the peer's uid",
}


def _effective(spec: dict[str, Any], namespace: str, name: str) -> dict[str, Any]:
    """The spec document with the API's defaults (a default counts as the value)."""
    return WeightCacheSpec.from_spec(spec or {}, namespace, name).to_dict()


def immutable_problems(
    old: dict[str, Any], new: dict[str, Any], namespace: str, name: str
) -> list[Problem]:
    """Problems for immutable fields changed on update (defaults count as the value)."""
    before, after = _effective(old, namespace, name), _effective(new, namespace, name)
    problems = []
    for key, why in IMMUTABLE.items():
        if before.get(key) != after.get(key):
            problems.append(
                Problem(
                    f"spec.{key}",
                    f"is immutable ({why}): it was {before.get(key)!r}, the update sets "
                    f"{after.get(key)!r}; keep the old value, or create a new WeightCache and "
                    f"point the engines' weightcache.io/cache annotation at it",
                )
            )
    return problems


def spec_changed(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Whether an UPDATE changes the spec (finalizer, metadata and status updates do not)."""
    return old is None or (old.get("spec") or {}) != (new.get("spec") or {})


def review(
    operation: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    subresource: str | None = None,
) -> list[Problem]:
    """All problems of one admission request for a WeightCache object (empty: admit)."""
    if operation not in {"CREATE", "UPDATE"} or new is None or subresource:
        return []
    meta = new.get("metadata") or {}
    if operation == "UPDATE" and (meta.get("deletionTimestamp") or not spec_changed(new, old)):
        return []
    spec = new.get("spec") or {}
    problems = []
    if operation == "CREATE" and meta.get("name"):  # names are immutable: judged once
        problems += specs.name_problems(meta["name"])
    problems += specs.validate(spec, meta.get("name"))
    if operation == "UPDATE" and old is not None:
        problems += immutable_problems(
            old.get("spec") or {}, spec, meta.get("namespace", "default"), meta.get("name", "")
        )
    return problems


def denial_message(problems: list[Problem]) -> str:
    return "; ".join(f"{p.field}: {p.message}" for p in problems)
