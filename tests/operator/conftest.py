"""The real kopf operator against kmock's Kubernetes emulator.

kmock has no controllers, so tests play the parts a cluster would: they create Nodes, and
act as the DaemonSet controller by creating agent pods on the nodes the DaemonSet is pinned
to (`materialize`), then flip their Ready condition. kmock fills no uid, resourceVersion or
generation and ignores label selectors; tests set uid/generation themselves.

kmock also accepts objects a real API server rejects. `ApiGuard` closes that gap: every
write the operator (or kopf) sends is checked against the API server's validation rules in
`weightcache.testing.apirules` and answered with 422 like the real server would; the test
fails at teardown when any write broke a rule, unless the test asked for the rejection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp.web
import jsonpatch
import pytest
from kmock._internal import enums
from kmock._internal.k8s import KubernetesEmulator

from weightcache import constants as C
from weightcache.operator import crd, handlers, main
from weightcache.testing import apirules, emulator

NS = "default"
CR_URL = f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}"


def cache_url(name: str) -> str:
    return f"{CR_URL}/{name}"


class Cluster:
    """Test-side access to the emulated API (the operator uses its own client)."""

    def __init__(self, kmock: Any) -> None:
        self.kmock = kmock

    async def get(self, url: str) -> dict | None:
        async with self.kmock.get(url) as resp:
            if resp.status == 404:
                return None
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def post(self, url: str, body: dict) -> dict:
        async with self.kmock.post(url, json=body) as resp:
            assert resp.status < 300, await resp.text()
            return await resp.json()

    async def patch(self, url: str, body: dict) -> dict:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.kmock.patch(url, json=body, headers=headers) as resp:
            assert resp.status < 300, await resp.text()
            return await resp.json()

    async def delete(self, url: str) -> None:
        async with self.kmock.delete(url) as resp:
            assert resp.status < 300, await resp.text()

    async def list(self, url: str) -> list[dict]:
        return (await self.get(url) or {}).get("items", [])

    # -- fleet ----------------------------------------------------------------------------

    async def add_node(self, name: str, gpus: int = 8, ready: bool = True, **labels: str):
        return await self.post("/api/v1/nodes", node(name, gpus, ready, labels))

    async def set_node_ready(self, name: str, ready: bool) -> None:
        status = "True" if ready else "False"
        await self.patch(
            f"/api/v1/nodes/{name}",
            {"status": {"conditions": [{"type": "Ready", "status": status}]}},
        )

    async def create_cache(self, name: str, spec: dict, generation: int = 1) -> dict:
        return await self.post(CR_URL, emulator.cache_object(name, NS, spec, generation))

    async def cache(self, name: str) -> dict | None:
        return await self.get(cache_url(name))

    async def status(self, name: str) -> dict:
        return ((await self.cache(name)) or {}).get("status") or {}

    # -- the DaemonSet controller's part ------------------------------------------------

    async def materialize(self, name: str, ready: bool = False, ip: str = "") -> list[dict]:
        """Create (or replace) one agent pod per node the DaemonSet is pinned to."""
        ds = await self.get(f"/apis/apps/v1/namespaces/{NS}/daemonsets/{name}-agent")
        assert ds is not None
        template = ds["spec"]["template"]
        nodes = emulator.schedulable_nodes(template["spec"], await self.list("/api/v1/nodes"))
        existing = {p["metadata"]["name"]: p for p in await self.agent_pods(name)}
        pods = []
        for node_name in nodes:
            pod_name = (
                f"{name}-agent-{node_name}-e{template['metadata']['annotations'][C.ANN_EPOCH]}"
            )
            pod_name += "-" + template["metadata"]["annotations"]["weightcache.io/plan-hash"][:6]
            if pod_name in existing:
                pods.append(existing.pop(pod_name))
                continue
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": NS,
                    "uid": str(uuid.uuid4()),
                    "labels": dict(template["metadata"]["labels"]),
                    "annotations": dict(template["metadata"]["annotations"]),
                },
                "spec": {**template["spec"], "nodeName": node_name},
                "status": pod_status(ready, ip=ip),
            }
            pods.append(await self.post(f"/api/v1/namespaces/{NS}/pods", body))
        for stale in existing:  # the DaemonSet controller replaces out-of-date pods
            await self.delete(f"/api/v1/namespaces/{NS}/pods/{stale}")
        return pods

    async def agent_pods(self, name: str) -> list[dict]:
        pods = await self.list(f"/api/v1/namespaces/{NS}/pods")
        return [p for p in pods if p["metadata"].get("labels", {}).get(C.LABEL_CACHE) == name]

    async def set_pods_ready(self, name: str, ready: bool = True, restarts: int = 0) -> None:
        for pod in await self.agent_pods(name):
            await self.patch(
                f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                {"status": pod_status(ready, restarts)},
            )


def node(name: str, gpus: int, ready: bool, labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": dict(labels)},
        "spec": {},
        "status": {
            "capacity": {"nvidia.com/gpu": str(gpus)},
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod_status(ready: bool, restarts: int = 0, ip: str = "") -> dict:
    return {
        "phase": "Running",
        **({"podIP": ip} if ip else {}),
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "agent", "ready": ready, "restartCount": restarts}],
    }


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 20.0, interval: float = 0.05
) -> Any:
    """Poll `check` until it returns a truthy value; fail with the last value on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last value: {last!r}")


declare_api = emulator.declare_api


def write_kubeconfig(path: Any, server: str) -> None:
    emulator.write_kubeconfig(path, server, namespace="default")


WC_SCHEMA = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
Rejecter = Callable[[str, dict], "str | None"]


class ApiGuard:
    """Judges every write not sent by the test itself, as the real API server's validation would.

    `violations` collects what broke a rule (the test fails on them at teardown); `reject`
    holds test-installed refusals `(method, object) -> message | None` that play a server
    rejecting a valid object (an admission plugin, a quota), answered with 422 as well.
    """

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.checked: list[tuple[str, str, str]] = []  # (method, kind/name, agent) judged
        self.reject: list[Rejecter] = []
        # Namespace objects by name: kmock cannot store Namespaces (it parses
        # /api/v1/namespaces/<name> as a namespace prefix), so the guard serves them.
        self.namespaces: dict[str, dict] = {}

    def judge(self, emulator: Any, request: Any) -> str | None:
        agent = str((request.headers or {}).get("User-Agent", ""))
        if request.resource is None or agent.startswith("kmock/"):  # the test's own client
            return None
        if request.action == enums.action.CREATE:
            obj = request.data or {}
        elif request.action == enums.action.UPDATE and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            if key not in emulator._objects or emulator._objects[key].deleted:
                return None  # kmock answers 404 itself
            stored = emulator._objects[key].raw
            if isinstance(request.data, list):  # kopf's JSON patches (RFC 6902)
                obj = jsonpatch.apply_patch(stored, request.data)
            else:
                obj = apirules.merge_patch(stored, request.data or {})
        else:
            return None
        meta = obj.get("metadata") or {}
        method = str(getattr(request.method, "value", request.method)).upper()
        self.checked.append((method, f"{obj.get('kind')}/{meta.get('name')}", agent))
        for rejecter in self.reject:
            message = rejecter(method, obj)
            if message:
                return message
        problems = apirules.check(obj, crd_schema=WC_SCHEMA)
        if not problems:
            return None
        message = f"{obj.get('kind')} {meta.get('name')!r} is invalid: " + "; ".join(
            str(p) for p in problems
        )
        self.violations.append(message)
        return message


@pytest.fixture
def api_guard(monkeypatch) -> ApiGuard:
    guard = ApiGuard()
    original = KubernetesEmulator._handle

    async def guarded(self: Any, request: Any) -> aiohttp.web.StreamResponse:
        parts = request.url.path.strip("/").split("/")
        namespace_get = parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 4
        if namespace_get and request.method.value.upper() == "GET" and parts[3] in guard.namespaces:
            return aiohttp.web.json_response(guard.namespaces[parts[3]])
        message = guard.judge(self, request)
        if message is None:
            return await original(self, request)
        return aiohttp.web.json_response(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "message": message,
                "reason": "Invalid",
                "code": 422,
            },
            status=422,
        )

    monkeypatch.setattr(KubernetesEmulator, "_handle", guarded)
    yield guard
    assert not guard.violations, "writes a real API server rejects:\n" + "\n".join(
        guard.violations
    )


@pytest.fixture
async def cluster(kmock, api_guard, tmp_path, monkeypatch) -> Cluster:
    declare_api(kmock)
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.url).rstrip("/"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return Cluster(kmock)


@contextlib.asynccontextmanager
async def running_operator(resync_s: float = 1.0, extra: tuple[str, ...] = ("--standalone",),
                           update_retry_s: float = 300.0):
    """The operator in a thread with its own event loop, as in a real process.

    kopf cancels every task created after it started when it stops, so it cannot share the
    test's event loop; kmock keeps serving from the test's loop while the test awaits.
    """
    flags = ["--namespace", NS, "--no-scanning", "--no-webhook", "--metrics-port", "0"]
    args = main.parser().parse_args([*flags, "--health-port", "0", *extra])
    ctl = handlers.Controller(options=handlers.Options(resync_s=resync_s, debounce_s=0.01,
                                                       update_retry_s=update_retry_s))
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(
                main.run(
                    args,
                    registry=handlers.registry,
                    stop_flag=stop,
                    ready_flag=ready,
                    controller=ctl,
                )
            )
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name="operator", daemon=True)
    thread.start()
    try:
        await eventually(_flag(ready, errors), timeout=15)
        yield ctl
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop"
        assert not errors, errors


def _flag(event: threading.Event, errors: list) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        if errors:
            raise AssertionError(f"the operator failed to start: {errors[0]!r}")
        return event.is_set()

    return check


@pytest.fixture
async def operator(cluster):
    async with running_operator() as ctl:
        yield ctl
