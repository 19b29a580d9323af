"""A small RBAC authorizer: is an API request allowed by a set of Roles and ClusterRoles?

It follows Kubernetes' rules for the requests an operator makes: the verb comes from the
HTTP method (GET on a collection is list, or watch with ?watch; on an object get), rules
match on API group, resource (with "/subresource"), verb and, when set, resource name; a
rule with resourceNames never authorizes list, watch or create; Role rules apply only in
their namespace. Discovery paths (/api, /apis/<group>/<version>) are not resource requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str  # "pods" or "weightcaches/status"
    namespace: str | None
    name: str | None


def attributes(method: str, path: str, params: Mapping[str, str]) -> Attributes | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None  # discovery of a group version
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    method = method.upper()
    if method == "GET":
        watching = params.get("watch") in ("true", "1")
        verb = "get" if name else ("watch" if watching else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, "")
        if method == "DELETE":
            verb = "delete" if name else "deletecollection"
    return Attributes(verb, group, resource, namespace, name)


def allowed(attrs: Attributes, roles: Iterable[Mapping[str, Any]]) -> bool:
    for role in roles:
        if role["kind"] == "Role" and role["metadata"]["namespace"] != attrs.namespace:
            continue
        for rule in role.get("rules", []):
            if attrs.group not in rule.get("apiGroups", []):
                continue
            if attrs.resource not in rule.get("resources", []):
                continue
            if attrs.verb not in rule.get("verbs", []):
                continue
            names = rule.get("resourceNames")
            if names and (attrs.verb in ("list", "watch", "create") or attrs.name not in names):
                continue
            return True
    return False
