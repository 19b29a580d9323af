"""The Grafana dashboard is well formed, and every panel's PromQL returns data from a real
Prometheus that scrapes a real node agent (native runtime, CPU, engines attaching) and the
real operator process (reconciling a WeightCache in kmock, answering admission reviews)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import Agent
from tests.agent.plans import make_plan
from tests.agent.prom import PromServer
from tests.chart import chart, rbac_eval
from weightcache import constants as C
from weightcache.testing import emulator
from weightcache.testing.ports import free_port
from weightcache.testing.processes import operator_cmd

DASHBOARD = chart.CHART / "dashboards" / "weightcache.json"
RULES = chart.CHART / "alerts" / "weightcache.rules.yaml"
# Values Grafana substitutes; the test selects everything the way "All" does.
VARIABLES = {"$namespace": ".*", "$cache": ".*", "$__rate_interval": "1m", "$__interval": "15s"}
REQUIRED_PANELS = [
    "Caches by phase",
    "Ranks ready / total per cache",
    "Bytes cached per node and GPU",
    "Load duration",
    "Daemon restarts",
    "Attach latency",
    "Attach results (cache vs. fallback)",
    "Fallback-causing mismatches by field",
    "Engines attached",
    "Reconciles by result",
    "Webhook latency",
    "GPU memory: caches vs. free",
]
# Targets on dcgm-exporter's series (GPU memory next to the caches); no GPU exporter runs here.
THIRD_PARTY = ("DCGM_",)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in panels(dash):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            found.append((f"{panel['title']} [{target['refId']}]", expr))
    return found


def test_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["uid"] == "weightcache" and dash["schemaVersion"] >= 36
    everything = panels(dash)
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in everything]
    for title in REQUIRED_PANELS:
        assert title in titles
    for panel in everything:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert "weightcache_" in target["expr"]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "namespace", "cache"]


def test_every_metric_the_dashboard_uses_is_documented():
    import re

    documented = (chart.ROOT / "docs" / "interfaces.md").read_text()
    for _, expr in queries(dashboard()):
        for metric in re.findall(r"\b(weightcache_[a-z_]+)", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", metric)
            if base.endswith("_total") and base not in documented:
                base = base.removesuffix("_total")
            assert base in documented or base.removesuffix("_total") in documented, metric


# -- the live test ---------------------------------------------------------------------------


def _declare_api(kmock: Any) -> None:
    emulator.declare_api(kmock)


def _kubeconfig(path: Path, server: str) -> Path:
    return emulator.write_kubeconfig(path, server, namespace="default")


CACHES = f"/apis/{C.API_VERSION}/namespaces/default/{C.PLURAL}"


def _cache(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "default",
        "uid": str(uuid.uuid4()),
        "resourceVersion": "1",
        "generation": 1,
    }
    return {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": meta, "spec": spec}


def _review(url: str, ctx: ssl.SSLContext, hook: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/{hook}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return json.loads(resp.read())


async def _wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            await asyncio.to_thread(urllib.request.urlopen, url, None, 1)
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never answered:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_every_panel_returns_data(kmock, tmp_path, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (make prometheus)")
    from weightcache.testing.checkpoints import TINY, write_llama_checkpoint
    from weightcache.testing.webhook import review_request

    # 1. A real agent with the native runtime on CPU.
    ckpt = write_llama_checkpoint(tmp_path / "ckpt", TINY)
    plan = make_plan(runtime="native", tensor=1, model=str(ckpt), spec_extra={"device": "cpu"})
    agent = Agent(tmp_path, plan).start()

    # 2. The real operator process against kmock, webhooks on loopback. The chart's own
    # Secret and webhook configurations are there first, as after `helm install`.
    _declare_api(kmock)
    chart_docs = chart.render()
    for doc in chart_docs:
        if doc["kind"] == "Secret":
            url = f"/api/v1/namespaces/{doc['metadata']['namespace']}/secrets"
        elif doc["kind"].endswith("WebhookConfiguration"):
            url = f"/apis/admissionregistration.k8s.io/v1/{doc['kind'].lower()}s"
        else:
            continue
        async with kmock.post(url, json=doc) as resp:
            assert resp.status < 300, await resp.text()
    kubeconfig = _kubeconfig(tmp_path / "kubeconfig", str(kmock.url).rstrip("/"))
    metrics_port, webhook_port = free_port(), free_port()
    certs = tmp_path / "certs"
    op_log = tmp_path / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "weightcache-system"}
    with open(op_log, "wb") as log:
        operator = subprocess.Popen(
            [
                *operator_cmd("default"),
                "--log-format",
                "text",
                "--health-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
                f"--metrics-port={metrics_port}",
                "--webhook-addr",
                "127.0.0.1",
                f"--webhook-port={webhook_port}",
                f"--webhook-url=https://127.0.0.1:{webhook_port}",
                f"--webhook-cert-dir={certs}",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    prom = None
    try:
        await _wait_http(f"http://127.0.0.1:{metrics_port}/metrics", operator, op_log)
        # One node and two caches: "llama" selects no node and stays Unschedulable, "placed"
        # gets its plan ConfigMap, rendezvous Service and agent DaemonSet on the node.
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a", "uid": str(uuid.uuid4()), "labels": {}},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        async with kmock.post("/api/v1/nodes", json=node) as resp:
            assert resp.status < 300, await resp.text()
        model = {"path": "/models/tiny", "volume": {"hostPath": {"path": "/m"}}}
        cache = _cache(
            "llama",
            {
                "runtime": "native",
                "device": "cpu",
                "model": model,
                "placement": {"nodeSelector": {"pool": "none"}},
            },
        )
        for body in (
            cache,
            _cache("placed", {"runtime": "native", "device": "cpu", "model": model}),
        ):
            async with kmock.post(CACHES, json=body) as resp:
                assert resp.status < 300, await resp.text()

        # Admission reviews over real HTTPS, verified against the CA the operator issued.
        deadline = time.monotonic() + 60
        while not (certs / "ca.crt").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await _wait_http_tls(webhook_port, certs, operator, op_log)
        ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        ctx.check_hostname = False  # the certificate names the Service, we dial loopback
        url = f"https://127.0.0.1:{webhook_port}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "engine",
                "namespace": "default",
                "annotations": {C.ANN_CACHE: "llama"},
            },
            "spec": {
                "containers": [
                    {"name": "engine", "image": "engine:1", "command": ["python", "serve.py"]}
                ]
            },
        }
        for _ in range(3):
            out = await asyncio.to_thread(_review, url, ctx, "inject-pod", review_request(pod))
            assert out["response"]["allowed"] is True
            out = await asyncio.to_thread(
                _review, url, ctx, "validate-weightcache", review_request(cache, resource=C.PLURAL)
            )
            assert "allowed" in out["response"]

        await asyncio.to_thread(agent.wait_ready, 120)
        # 3. Prometheus scrapes both; every panel query must return series.
        prom = PromServer(
            tmp_path / "prom",
            [agent.metrics_target],
            interval="1s",
            rule_files=[str(RULES)],
            extra_scrape_configs=[
                {
                    "job_name": "weightcache-operator",
                    "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                }
            ],
        )
        await asyncio.to_thread(prom.start)
        await asyncio.to_thread(prom.wait_for, "weightcache_agent_ready", lambda r: len(r) == 1, 60)
        # 4. Engines attach while Prometheus watches: one served, one refused (dtype), in two
        # rounds, so the counters' series exist and then move inside the scraped window.
        for round_ in (1, 2):
            for extra in ((), ("--dtype", "float32")):
                done = await asyncio.to_thread(
                    subprocess.run,
                    [
                        sys.executable,
                        "-m",
                        "weightcache.cli",
                        "attach",
                        "--model",
                        str(ckpt),
                        "--device",
                        "cpu",
                        "--weight-cache-socket-dir",
                        agent.socket_dir,
                        *extra,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    cwd="/",
                )
                assert done.returncode == 0, done.stderr
            await asyncio.to_thread(
                prom.wait_for,
                'sum(weightcache_daemon_requests_total{command="get_state"})',
                lambda r, n=2 * round_: bool(r) and float(r[0]["value"][1]) >= n,
                60,
            )
        waiting = {t: e for t, e in queries(dashboard()) if not any(m in e for m in THIRD_PARTY)}
        results: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + 60
        while waiting and time.monotonic() < deadline:
            for title, expr in list(waiting.items()):
                result = await asyncio.to_thread(prom.query, expr)
                if result:
                    results[title] = result
                    del waiting[title]
            await asyncio.sleep(0.5)
        assert not waiting, f"panels without data: {sorted(waiting)}"

        # The values say what happened, not just that series exist.
        def by(title: str) -> dict[str, float]:
            return {
                ",".join(f"{k}={v}" for k, v in sorted(r["metric"].items())): float(r["value"][1])
                for r in results[title]
            }

        assert by("Ranks ready / total per cache [A]") == {"cache=llama,namespace=default": 1.0}
        assert by("Ranks ready / total per cache [B]") == {"cache=llama,namespace=default": 1.0}
        assert all(v > 0 for v in by("Bytes cached per node and GPU [A]").values())
        # DCGM-compatible labels: the GPU memory panel joins dcgm-exporter's series on UUID.
        gpu = by("GPU memory: caches vs. free [A]")
        assert gpu and all("UUID=" in k and "Hostname=" in k for k in gpu), gpu
        results_by = {
            k.split("result=")[1]: v
            for k, v in by("Attach results (cache vs. fallback) [A]").items()
        }
        assert results_by.keys() >= {"ok", "mismatch"}
        fields = by("Fallback-causing mismatches by field [A]")
        assert any("field=dtype" in k for k in fields)
        webhooks = by("Webhook requests by result [A]")
        assert any("webhook=inject-pod" in k for k in webhooks)
        assert any("webhook=validate-weightcache" in k for k in webhooks)
        expiry = by("Webhook certificate expires in [A]")
        assert 300 * 86400 < next(iter(expiry.values())) <= 366 * 86400
        phases = {k: v for k, v in by("Caches by phase [A]").items()}
        assert sum(phases.values()) == 2.0
        assert phases["phase=Unschedulable"] == 1.0

        # The shipped alerts evaluate on the same series: the unschedulable cache and the
        # half-refused attaches are pending alerts (their `for:` keeps them from firing yet).
        def pending() -> dict[str, dict[str, str]]:
            alerts = prom.api("alerts")["alerts"]
            return {
                a["labels"]["alertname"]: a["labels"] for a in alerts if a["state"] == "pending"
            }

        deadline = time.monotonic() + 30
        seen = await asyncio.to_thread(pending)
        while not {"WeightCacheDegraded", "WeightCacheFallbackRateHigh"} <= seen.keys():
            assert time.monotonic() < deadline, f"alerts not pending: {seen}"
            await asyncio.sleep(0.5)
            seen = await asyncio.to_thread(pending)
        assert seen["WeightCacheDegraded"]["phase"] in {"Unschedulable", "Degraded", "Invalid"}
        assert seen["WeightCacheFallbackRateHigh"]["cache"] == "llama"
        assert "WeightCacheRankDown" not in seen and "WeightCacheWebhookErrors" not in seen

        # The placed cache owns its objects; deleting it makes the operator remove them.
        async def get(url: str) -> int:
            async with kmock.get(url) as resp:
                return resp.status

        ds_url = "/apis/apps/v1/namespaces/default/daemonsets/placed-agent"
        assert await get(ds_url) == 200
        async with kmock.delete(f"{CACHES}/placed") as resp:
            assert resp.status < 300, await resp.text()
        deadline = time.monotonic() + 30
        while await get(f"{CACHES}/placed") != 404 or await get(ds_url) != 404:
            assert time.monotonic() < deadline, "the operator did not finish the deletion"
            await asyncio.sleep(0.2)

        # Every API request the operator made is allowed by the chart's RBAC.
        roles = [d for d in chart_docs if d["kind"] in ("ClusterRole", "Role")]
        roles = [r for r in roles if r["metadata"]["name"].endswith("-operator")]
        made = set()
        for request in list(kmock):
            if request.headers.get("Authorization") != "Bearer test":
                continue  # the test's own requests
            method = request.method.value
            attrs = rbac_eval.attributes(method, request.url.path, request.params)
            if attrs is not None:
                made.add(attrs)
        denied = sorted(str(a) for a in made if not rbac_eval.allowed(a, roles))
        assert not denied, denied
        used = {(a.verb, a.resource) for a in made}
        assert {
            ("watch", "weightcaches"),
            ("patch", "weightcaches/status"),
            ("patch", "secrets"),
            ("patch", "mutatingwebhookconfigurations"),
            ("patch", "validatingwebhookconfigurations"),
            ("create", "events"),
            ("watch", "nodes"),
            ("watch", "pods"),
            ("create", "daemonsets"),
            ("create", "services"),
            ("create", "configmaps"),
            ("delete", "daemonsets"),
            ("delete", "services"),
            ("delete", "configmaps"),
        } <= used, sorted(used)
        # Grafana's template variables resolve through the label values API.
        assert "default" in await asyncio.to_thread(
            prom.api, "label/namespace/values", **{"match[]": "weightcache_rank_ready"}
        )
        assert "llama" in await asyncio.to_thread(
            prom.api, "label/cache/values", **{"match[]": "weightcache_rank_ready"}
        )
    finally:
        if prom is not None:
            prom.stop()
        operator.terminate()
        try:
            operator.wait(20)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        agent.close()


async def _wait_http_tls(port: int, certs: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise AssertionError(f"webhook never listened:\n{log.read_text()[-4000:]}")
