"""`weightcache operator` as a real process serves the webhooks (kmock as the API server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.admission import pods
from tests.admission.conftest import cache_obj
from weightcache import constants as C
from weightcache.testing import emulator
from weightcache.testing.ports import free_port
from weightcache.testing.processes import operator_cmd
from weightcache.testing.webhook import decode_patch, review_request


async def _wait_for(path: Path, port: int, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise AssertionError(f"operator exited with {proc.returncode}")
        if path.exists():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                pass
        await asyncio.sleep(0.1)
    raise AssertionError("the operator's webhook server did not come up in 60 s")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


async def test_operator_cli_serves_injection_and_validation(kmock: Any, tmp_path: Path) -> None:
    emulator.declare_api(kmock)
    server = str(kmock.url).rstrip("/")
    kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig", server)
    cache = cache_obj()
    async with aiohttp.ClientSession() as api:
        base = f"{server}/apis/{C.GROUP}/{C.VERSION}/namespaces/serving/{C.PLURAL}"
        async with api.post(base, json=cache) as resp:
            assert resp.status < 300

    port, certs = free_port(), tmp_path / "certs"
    log = (tmp_path / "operator.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        *operator_cmd("serving"),
        "--metrics-port",
        "0",
        "--health-port",
        "0",
        "--log-format",
        "text",
        "--webhook-namespace",
        "weightcache-system",
        "--webhook-addr",
        "127.0.0.1",
        "--webhook-port",
        str(port),
        "--webhook-url",
        f"https://127.0.0.1:{port}",
        "--webhook-cert-dir",
        str(certs),
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        try:
            await _wait_for(certs / "ca.crt", port, proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_tail(tmp_path / 'operator.log')}") from None
        ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as hook:
            pod = pods.serve_args_pod(cache["metadata"]["name"])
            async with hook.post(
                f"https://127.0.0.1:{port}/inject-pod", json=review_request(pod)
            ) as r:
                out = json.loads(await r.read())
            ops = decode_patch(out)
            assert out["response"]["allowed"] is True
            assert {"op": "add", "path": "/spec/hostIPC", "value": True} in ops

            bad = cache_obj(name="bad")
            bad["spec"]["parallelism"] = {"pipeline": 2}
            req = review_request(bad, resource=C.PLURAL)
            async with hook.post(f"https://127.0.0.1:{port}/validate-weightcache", json=req) as r:
                out = json.loads(await r.read())
            assert out["response"]["allowed"] is False
            assert "spec.parallelism.pipeline" in out["response"]["status"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()
