"""Fixtures of the kind suite: a kubectl/helm pair bound to the cluster run.sh created.

The suite needs a Docker engine, kind and the images run.sh builds; without them every test
skips with the reason, so `pytest e2e` is safe anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = Path(__file__).resolve().parent / "manifests"
RELEASE = "weightcache"
RELEASE_NS = "weightcache-system"
NS = "wc-e2e"


def _why_not() -> str | None:
    if os.environ.get("WEIGHTCACHE_E2E_KUBECONFIG"):
        return None
    if shutil.which("docker") is None:
        return (
            "needs a Docker engine and kind (no docker CLI here); run e2e/run.sh where they exist"
        )
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "needs a Docker engine and kind (no Docker engine answers); run e2e/run.sh"
    if shutil.which("kind") is None:
        return "needs kind; run e2e/run.sh where kind is installed"
    return "run through e2e/run.sh, which builds the images and creates the kind cluster"


def _tool(name: str) -> str:
    local = ROOT / ".venv" / "tools" / name
    return str(local) if local.exists() else (shutil.which(name) or name)


class Kube:
    """kubectl and helm against the suite's cluster."""

    def __init__(self, kubeconfig: str) -> None:
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def run(
        self,
        tool: str,
        *args: str,
        check: bool = True,
        timeout: float = 300,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [_tool(tool), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            input=input,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)}: {proc.stderr or proc.stdout}")
        return proc

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kw)

    def helm(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kw)

    def get(self, *args: str) -> Any:
        out = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def items(self, *args: str) -> list[dict[str, Any]]:
        return (self.get(*args) or {}).get("items", [])

    def logs(self, pod: str, namespace: str = NS) -> str:
        return self.kubectl("logs", "-n", namespace, pod, check=False).stdout

    def wait_for(
        self, what: str, check: Callable[[], Any], timeout: float = 300, interval: float = 2.0
    ) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture(scope="session")
def kube() -> Kube:
    reason = _why_not()
    if reason:
        pytest.skip(f"e2e: {reason}")
    return Kube(os.environ["WEIGHTCACHE_E2E_KUBECONFIG"])
