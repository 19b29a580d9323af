"""A real webhook stack on loopback, for tests and the admission benchmark.

The real kopf operator with only the admission handlers runs in a background thread
against `kmock` (an in-memory Kubernetes API), serving HTTPS on 127.0.0.1 with a
certificate the keeper issued and stored in a Secret, exactly as in a cluster. Callers
send real AdmissionReview v1 JSON over HTTPS, verified against the published CA.
kmock is a test dependency (`pip install -e .[test]`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import kopf

from weightcache import constants as C
from weightcache.operator import admission
from weightcache.operator.admission.config import INDEX_ID, MUTATE_ID, VALIDATE_ID, AdmissionConfig
from weightcache.operator.kube import Kube
from weightcache.testing import emulator
from weightcache.testing.ports import free_port

NAMESPACE = "weightcache-system"
RESOURCES = {
    "pods": {"group": "", "version": "v1", "resource": "pods", "kind": "Pod"},
    C.PLURAL: {"group": C.GROUP, "version": C.VERSION, "resource": C.PLURAL, "kind": C.KIND},
}



def review_request(
    obj: dict[str, Any] | None,
    *,
    resource: str = "pods",
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """An AdmissionReview v1 request as the API server sends it."""
    res = RESOURCES[resource]
    gvk = {"group": res["group"], "version": res["version"], "kind": res["kind"]}
    gvr = {"group": res["group"], "version": res["version"], "resource": res["resource"]}
    meta = (obj or old or {}).get("metadata") or {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace", ""),
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": str(uuid.uuid4()),
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": obj,
            "oldObject": old,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def decode_patch(response: dict[str, Any]) -> list[dict[str, Any]]:
    payload = response["response"]
    if "patch" not in payload:
        return []
    assert payload.get("patchType") == "JSONPatch"
    return json.loads(base64.b64decode(payload["patch"]))


class LocalWebhook:
    """Start with `start()`, stop with `stop()`; or use as a context manager."""

    def __init__(self, cert_dir: str | Path | None = None, **config: Any) -> None:
        self._tmp = None if cert_dir else tempfile.TemporaryDirectory(prefix="wc-webhook-")
        self.cert_dir = Path(cert_dir or self._tmp.name)  # type: ignore[union-attr]
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.config = AdmissionConfig(
            namespace=NAMESPACE,
            addr="127.0.0.1",
            port=self.port,
            url=self.url,
            cert_dir=str(self.cert_dir),
            extra_sans=("127.0.0.1", "localhost"),
            check_interval_s=3600.0,
            reload_interval_s=0.5,
            **config,
        )
        self.loop = asyncio.new_event_loop()
        self.kmock: Any = None
        self._thread = threading.Thread(target=self._run, name="webhook", daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.ssl: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ lifecycle

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced to the caller of start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        import kmock

        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s):
            emulator.declare_api(k8s)
            self.kmock = k8s
            server = str(k8s.url).rstrip("/")

            def login() -> kopf.ConnectionInfo:
                return kopf.ConnectionInfo(server=server)

            registry = kopf.OperatorRegistry()

            @kopf.on.login(registry=registry)
            def _login(**_: Any) -> kopf.ConnectionInfo:
                return login()

            @kopf.on.startup(registry=registry)
            def _settings(settings: kopf.OperatorSettings, **_: Any) -> None:
                settings.scanning.disabled = True  # kmock answers 500 on namespace listing
                settings.posting.enabled = False
                settings.watching.server_timeout = 60

            self.api = Kube(login())
            admission.register(registry, self.config, api=self.api)
            ready = asyncio.Event()
            op = asyncio.create_task(
                kopf.operator(
                    registry=registry,
                    clusterwide=True,
                    standalone=True,
                    stop_flag=self._stop,
                    ready_flag=ready,
                )
            )
            await self._wait_serving(op)
            self._ready.set()
            await op
            await self.api.close()

    async def _wait_serving(self, op: asyncio.Task[Any]) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if op.done():
                op.result()
                raise RuntimeError("the operator exited before serving")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                ca = self.cert_dir / "ca.crt"
                self.ssl = ssl.create_default_context(cafile=str(ca))
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError("the webhook server did not start in 30 s")

    def start(self) -> LocalWebhook:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise RuntimeError(f"webhook harness failed: {self._error!r}") from self._error
        if self.ssl is None:
            raise TimeoutError("webhook harness did not become ready")
        return self

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalWebhook:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def put_cache(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a WeightCache through the API (so kopf's index sees it)."""
        meta = obj["metadata"]
        base = f"/apis/{C.GROUP}/{C.VERSION}/namespaces/{meta['namespace']}/{C.PLURAL}"

        async def go() -> dict[str, Any]:
            existing = await self.api.get(f"{base}/{meta['name']}")
            if existing is None:
                return await self.api.create(base, obj)
            return await self.api.patch(f"{base}/{meta['name']}", obj)

        return self.call(go())

    def review(
        self,
        obj: dict[str, Any] | None,
        *,
        webhook: str | None = None,
        resource: str = "pods",
        operation: str = "CREATE",
        old: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """POST one AdmissionReview over HTTPS; return the parsed AdmissionReview response."""
        hook = webhook or (MUTATE_ID if resource == "pods" else VALIDATE_ID)
        body = review_request(obj, resource=resource, operation=operation, old=old, dry_run=dry_run)
        req = urllib.request.Request(
            f"{self.url}/{hook}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, context=self.ssl, timeout=10) as resp:
            out = json.loads(resp.read())
        assert out["response"]["uid"] == body["request"]["uid"]
        return out

    def events(self, namespace: str) -> list[dict[str, Any]]:
        out = self.call(self.api.get(f"/api/v1/namespaces/{namespace}/events"))
        return list((out or {}).get("items") or [])

    def requests_to(self, path_part: str) -> int:
        """How many API requests kmock saw whose path contains `path_part`."""
        return sum(1 for r in list(self.kmock) if path_part in str(r.url))


__all__ = ["INDEX_ID", "LocalWebhook", "decode_patch", "review_request"]
