"""`weightcache bench operator`: convergence time and API calls of the operator for a fleet.

The real operator (`weightcache operator` as a separate process, as in a pod) runs
against kmock's Kubernetes emulator holding 1 to 1000 simulated GPU nodes. For each fleet
size and cache size (1 to 16 nodes) the benchmark measures:
- placed: cache created -> status Placing (plan, Service, DaemonSet written);
- ready: agent pods created and Ready -> status Ready (node labels set);
- API calls the operator made (kopf's and the reconciler's, by verb), from the emulator's
  request log; calls by this harness are excluded by their User-Agent.
A steady-state row counts the calls of one idle resync, which is what a fleet pays forever.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

from weightcache import constants as C
from weightcache.bench.report import add_smoke_flag
from weightcache.testing import emulator
from weightcache.testing.ports import free_port
from weightcache.testing.processes import operator_cmd

HARNESS_AGENT = "weightcache-bench"
NS = "default"


def _node(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": {"pool": "gpu"}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _emulator_class() -> type:
    """kmock's emulator with a bounded request log.

    kmock 0.8 matches every request against its whole request history, so its cost grows
    with the square of the requests served and a 1000-node fleet would measure the emulator,
    not the operator. This subclass counts requests by (User-Agent, method) and keeps only the
    most recent ones in the log (requests in flight are always among them).
    """
    import kmock

    class TrimmedEmulator(kmock.KubernetesEmulator):
        keep = 16

        def __attrs_post_init__(self) -> None:
            super().__attrs_post_init__()
            self.counted: Counter[tuple[str, str]] = Counter()
            self.seen = 0

        async def __call__(self, raw_request: Any) -> Any:
            log = self._requests
            if len(log) > 2 * self.keep:
                for request in log[: -self.keep]:
                    agent = request.headers.get("User-Agent", "")
                    method = request.method.value if request.method else "?"
                    self.counted[(agent, method)] += 1
                del log[: -self.keep]
            return await super().__call__(raw_request)

    return TrimmedEmulator


class _Harness:
    def __init__(self, kmock: Any, session: Any) -> None:
        self.kmock = kmock
        self.session = session
        self.base = str(kmock.url).rstrip("/")

    async def call(self, method: str, url: str, body: Any = None) -> Any:
        headers = {"User-Agent": HARNESS_AGENT}
        if method == "PATCH":
            headers["Content-Type"] = "application/merge-patch+json"
        async with self.session.request(method, self.base + url, json=body, headers=headers) as r:
            if r.status >= 400:
                raise RuntimeError(f"{method} {url}: {r.status} {await r.text()}")
            return await r.json() if r.status != 204 else None

    def operator_calls(self) -> Counter[str]:
        """Requests served so far that did not come from this harness, by method."""
        calls: Counter[str] = Counter()
        for (agent, method), count in self.kmock.counted.items():
            if agent != HARNESS_AGENT:
                calls[method] += count
        for request in list(self.kmock._requests):
            if request.headers.get("User-Agent") != HARNESS_AGENT:
                calls[str(request.method.value if request.method else "?")] += 1
        return calls

    async def wait_phase(self, name: str, phase: str, timeout: float) -> float:
        t0 = time.perf_counter()
        url = f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}/{name}"
        while time.perf_counter() - t0 < timeout:
            body = await self.call("GET", url)
            if (body.get("status") or {}).get("phase") == phase:
                return time.perf_counter() - t0
            await asyncio.sleep(0.01)
        raise TimeoutError(f"{name} did not reach {phase} in {timeout}s")

    async def materialize(self, name: str) -> None:
        """Play the DaemonSet controller: one Ready agent pod per pinned node."""
        ds = await self.call("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets/{name}-agent")
        template = ds["spec"]["template"]
        fleet = (await self.call("GET", "/api/v1/nodes"))["items"]
        nodes = emulator.schedulable_nodes(template["spec"], fleet)
        for node in nodes:
            await self.call(
                "POST",
                f"/api/v1/namespaces/{NS}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{name}-agent-{node}",
                        "namespace": NS,
                        "uid": str(uuid.uuid4()),
                        "labels": template["metadata"]["labels"],
                        "annotations": template["metadata"]["annotations"],
                    },
                    "spec": {**template["spec"], "nodeName": node},
                    "status": {
                        "phase": "Running",
                        "conditions": [{"type": "Ready", "status": "True"}],
                        "containerStatuses": [{"name": "agent", "restartCount": 0}],
                    },
                },
            )



async def _metric(session: Any, port: int, name: str) -> float:
    """One sample of the operator's /metrics (sum over label sets)."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _fleet(fleet: int, sizes: list[int], resync_s: float) -> list[dict[str, Any]]:
    """One emulated cluster and one operator process; caches of each size in turn."""
    import aiohttp
    import kmock

    rows = []
    async with _emulator_class()() as k8s, kmock.Server(k8s):
        emulator.declare_api(k8s)
        async with aiohttp.ClientSession() as session:
            h = _Harness(k8s, session)
            for i in range(fleet):
                await h.call("POST", "/api/v1/nodes", _node(f"gpu-{i:04d}", 8))
            with tempfile.TemporaryDirectory() as tmp:
                kubeconfig = os.path.join(tmp, "kubeconfig")
                emulator.write_kubeconfig(kubeconfig, h.base, token="bench")
                port = free_port()
                t_start = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    *operator_cmd(NS, "--no-webhook"),
                    "--metrics-host",
                    "127.0.0.1",
                    "--metrics-port",
                    str(port),
                    "--health-port",
                    "0",
                    "--resync-seconds",
                    str(resync_s),
                    "--log-level",
                    "error",
                    env={**os.environ, "KUBECONFIG": kubeconfig},
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                try:
                    # Startup ends when the operator has listed and indexed every node.
                    while True:
                        try:
                            if await _metric(session, port, "weightcache_operator_nodes") >= fleet:
                                break
                        except aiohttp.ClientError:
                            pass
                        if proc.returncode is not None:
                            raise RuntimeError("the operator exited during start-up")
                        await asyncio.sleep(0.02)
                    startup_s = time.perf_counter() - t_start
                    for size in sizes:
                        rows.append(await _cache_round(h, session, port, fleet, size, startup_s))
                finally:
                    proc.terminate()
                    await proc.wait()
    return rows


async def _cache_round(
    h: _Harness, session: Any, port: int, fleet: int, size: int, startup_s: float
) -> dict[str, Any]:
    name = f"bench-{size}"
    url = f"/apis/{C.API_VERSION}/namespaces/{NS}/{C.PLURAL}"
    base = h.operator_calls()
    t0 = time.perf_counter()
    await h.call(
        "POST",
        url,
        emulator.cache_object(name, NS, {
            "runtime": "native",
            "model": {"path": "/models/m"},
            "parallelism": {"tensor": 8 * size, "nodes": size},
            "placement": {"nodeSelector": {"pool": "gpu"}},
        }),
    )
    await h.wait_phase(name, "Placing", 120)
    placed_s = time.perf_counter() - t0
    placed_calls = h.operator_calls() - base
    t1 = time.perf_counter()
    await h.materialize(name)
    await h.wait_phase(name, "Ready", 120)
    ready_s = time.perf_counter() - t1
    ready_calls = h.operator_calls() - base - placed_calls
    # One idle resync of this cache: what the steady state costs.
    before = h.operator_calls()
    rounds = await _metric(session, port, "weightcache_operator_reconciles_total")
    while await _metric(session, port, "weightcache_operator_reconciles_total") < rounds + 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    idle_calls = h.operator_calls() - before
    # Delete it so the next round starts from the same fleet.
    await h.call("DELETE", f"{url}/{name}")
    t2 = time.perf_counter()
    while time.perf_counter() - t2 < 60:
        try:
            await h.call("GET", f"{url}/{name}")
        except RuntimeError:
            break
        await asyncio.sleep(0.05)
    deleted_s = time.perf_counter() - t2
    return {
        "fleet": fleet,
        "cacheNodes": size,
        "startupSeconds": round(startup_s, 4),
        "placedSeconds": round(placed_s, 4),
        "readySeconds": round(ready_s, 4),
        "deletedSeconds": round(deleted_s, 4),
        "placedCalls": dict(placed_calls),
        "readyCalls": dict(ready_calls),
        "idleResyncCalls": dict(idle_calls),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (fleet, cache size) pair that fits; returns the JSON-able report."""
    rows = []
    for fleet in args.fleet:
        sizes = [size for size in args.cache_nodes if size <= fleet]
        if sizes:
            rows += asyncio.run(_fleet(fleet, sizes, args.resync))
    return {"benchmark": "operator", "rows": rows}


def _total(calls: dict[str, int]) -> int:
    return sum(calls.values())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="weightcache bench operator", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cpu", help="ignored (the operator needs no device)")
    p.add_argument("--fleet", type=int, nargs="+", default=[1, 10, 100, 1000])
    p.add_argument("--cache-nodes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--resync", type=float, default=2.0, help="operator resync period (s)")
    p.add_argument("--json", action="store_true", help="print the JSON report only")
    add_smoke_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # a multi-node cache: one agent pod per pinned node must come up
        args.fleet, args.cache_nodes = [4], [1, 4]
    logging.getLogger("kopf").setLevel(logging.ERROR)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("  operator convergence against kmock (seconds; API calls by the operator)")
    print(
        f"    {'fleet':>6} {'cache':>5} {'start':>7} {'placed':>7} {'calls':>6}"
        f" {'ready':>7} {'calls':>6} {'idle':>5} {'delete':>7}"
    )
    for r in report["rows"]:
        print(
            f"    {r['fleet']:>6} {r['cacheNodes']:>5} {r['startupSeconds']:>7.3f}"
            f" {r['placedSeconds']:>7.3f} {_total(r['placedCalls']):>6}"
            f" {r['readySeconds']:>7.3f} {_total(r['readyCalls']):>6}"
            f" {_total(r['idleResyncCalls']):>5} {r['deletedSeconds']:>7.3f}"
        )
    print("    start: operator process start until every node is indexed (s)")
    print("    placed: cache created -> Placing: plan, Service, DaemonSet written (s, calls)")
    print("    ready: agent pods Ready -> cache Ready, node labels set (s, calls)")
    print("    idle: API calls of one steady-state resync of one cache")
    sys.stdout.flush()
    return 0
