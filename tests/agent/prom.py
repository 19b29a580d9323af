"""A real Prometheus server for tests (Debian's `prometheus`, `make prometheus`).

Reusable outside the agent tests:

    with PromServer(tmp_path, targets=["127.0.0.1:9478"]) as prom:
        prom.wait_for('weightcache_agent_ready{cache="llama"}',
                      lambda r: bool(r) and r[0]["value"][1] == "1")

The server listens on loopback only, stores into a temporary directory and scrapes every
`interval`; `rule_files` lets alerting/recording rules be loaded and queried too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from weightcache.testing.ports import free_port


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PromServer:
    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        job: str = "weightcache-agent",
        interval: str = "1s",
        rule_files: list[str] | None = None,
        extra_scrape_configs: list[dict[str, Any]] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]},
                               *(extra_scrape_configs or [])],
        }
        if rule_files:
            self.config["rule_files"] = [str(p) for p in rule_files]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "prometheus.log"

    def start(self, timeout: float = 30.0) -> PromServer:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus is not installed (run `make prometheus`)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config))
        log = open(self.log_path, "wb")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> PromServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus API error: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant vector/scalar result of a PromQL query."""
        return self.api("query", query=promql)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, promql: str, predicate: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.3)
        raise TimeoutError(f"{promql!r} never matched; last result {result}")
