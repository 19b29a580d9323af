"""Thin async access to the Kubernetes API for the reconciler.

kopf watches and dispatches; this client does the reads and writes the reconciler needs
(get, create, merge-patch, delete) over aiohttp with the same credentials kopf uses:
`kopf.login_with_service_account` in a pod, else `kopf.login_with_kubeconfig`, evaluated
when a client is created (so KUBECONFIG is read at call time, never at import). Every
request is counted by verb, which the benchmark reports as the operator's API cost.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from weightcache import __version__
from weightcache.errors import ProjectError

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = f"weightcache-operator/{__version__}"
# Responses larger than this are not something the operator ever asks for.
MAX_RESPONSE_BYTES = 64 << 20


class ApiError(ProjectError):
    """A non-success answer of the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def login() -> kopf.ConnectionInfo:
    """Credentials the way kopf finds them: in-cluster service account, else kubeconfig."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig (set KUBECONFIG)")
    return info


def path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection or object, e.g. path("apps/v1", "daemonsets", "ns", "x")."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class Kube:
    """One aiohttp session against one API server; counts requests by verb."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout_s: float = 30.0) -> None:
        self.server = str(info.server).rstrip("/")
        headers = {
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
            **info.as_http_headers(),
        }
        ssl: Any = None
        if self.server.startswith("https"):
            ssl = False if info.insecure else info.as_ssl_context()
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=ssl, limit=32),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )
        self.calls: Counter[str] = Counter()

    @classmethod
    def connect(cls, **kwargs: Any) -> Kube:
        return cls(login(), **kwargs)

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        self.calls[method] += 1
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else None
        async with self._session.request(
            method, self.server + url, data=data, params=params, headers=headers
        ) as response:
            raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
            if len(raw) > MAX_RESPONSE_BYTES:
                raise ApiError(response.status, "TooLarge", f"{method} {url}: response too large")
            try:
                payload = json.loads(raw) if raw else {}
            except ValueError:
                payload = {"message": raw[:200].decode(errors="replace")}
            if response.status >= 400:
                raise ApiError(
                    response.status,
                    str(payload.get("reason") or response.reason),
                    str(payload.get("message") or ""),
                )
            return payload

    async def get(self, url: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", url)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, url: str, **params: str) -> list[dict[str, Any]]:
        return list((await self.request("GET", url, params=params or None)).get("items") or [])

    async def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", url, body=body)

    async def patch(self, url: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch (RFC 7386); None when the object does not exist."""
        try:
            return await self.request("PATCH", url, body=body, content_type=MERGE_PATCH)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, url: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        try:
            await self.request(
                "DELETE", url, body={"kind": "DeleteOptions", "propagationPolicy": "Background"}
            )
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
