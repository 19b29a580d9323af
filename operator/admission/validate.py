"""Validation of WeightCache create/update: what the CRD schema cannot express.

The semantic rules live in `weightcache.operator.spec.validate`, shared with the operator
(which reports them as an Invalid condition); this module adds what only an admission
review can see: the old object on update. Every denial names the field and the fix.
"""

from __future__ import annotations

from typing import Any

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
    return specs.with_defaults(spec or {}, namespace, name)


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


def review(
    operation: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
) -> list[Problem]:
    """All problems of one admission request for a WeightCache object."""
    if operation not in {"CREATE", "UPDATE"} or new is None:
        return []
    meta = new.get("metadata") or {}
    spec = new.get("spec") or {}
    problems = list(specs.validate(spec))
    if operation == "UPDATE" and old is not None:
        problems += immutable_problems(
            old.get("spec") or {}, spec, meta.get("namespace", "default"), meta.get("name", "")
        )
    return problems


def denial_message(problems: list[Problem]) -> str:
    return "; ".join(f"{p.field}: {p.message}" for p in problems)
