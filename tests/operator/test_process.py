"""`weightcache operator` as a real process: JSON logs, /metrics, /healthz, clean stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp

from tests.operator.conftest import eventually
from tests.operator.test_operator import TP16
from weightcache.testing.ports import free_port
from weightcache.testing.processes import operator_cmd


async def test_operator_process_serves_metrics_and_health(cluster, tmp_path):
    metrics_port, health_port = free_port(), free_port()
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *operator_cmd(
                "default", "--no-webhook", "--metrics-host", "127.0.0.1",
                "--metrics-port", str(metrics_port), "--health-port", str(health_port),
                "--log-format", "json",
            ),
            env=dict(os.environ),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        for n in ("gpu-a", "gpu-b"):
            await cluster.add_node(n)
        await cluster.create_cache("llama", TP16)

        async def placed():
            return (await cluster.status("llama")).get("phase") == "Placing"

        await eventually(placed, timeout=20)
        async with aiohttp.ClientSession() as http:

            async def scraped():
                async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    text = await r.text()
                return text if 'weightcache_operator_caches{phase="Placing"} 1.0' in text else None

            text = await eventually(scraped, timeout=10)
            assert 'weightcache_operator_reconciles_total{result="ok"}' in text
            assert "weightcache_operator_reconcile_duration_seconds_count" in text
            assert "weightcache_operator_nodes 2.0" in text

            async def healthy():
                try:
                    async with http.get(f"http://127.0.0.1:{health_port}/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(healthy, timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), timeout=30)
    assert code == 0, log.read_text()[-2000:]
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines, "the operator logged nothing"
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all("message" in r for r in records)
