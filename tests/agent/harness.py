"""Run `weightcache agent` as a real process the way its pod would, and talk to it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from weightcache.contracts.proto import agent_pb2, agent_pb2_grpc
from weightcache.testing.ports import free_port

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")
REPO = Path(__file__).resolve().parents[2]


def fake_vllm_bin(directory: Path) -> str:
    """An executable `vllm` that runs the stand-in with this interpreter."""
    path = directory / "vllm"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    path.chmod(0o755)
    return str(path)


class Agent:
    """One agent process with its own plan file, ports and short socket dir.

    `host` is its pod IP (it binds there): agents of several nodes on one machine listen on
    127.0.0.1, 127.0.0.2, ... with the same `ports`, as pods of a DaemonSet do."""

    def __init__(self, workdir: Path, plan: dict[str, Any], *, node: str = "gpu-a",
                 env: dict[str, str] | None = None, args: list[str] | None = None,
                 host: str = "127.0.0.1", ports: dict[str, int] | None = None) -> None:
        self.workdir = workdir
        self.host = host
        self.sock_root = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
        self.socket_dir = str(self.sock_root / "s")
        self.ports = {"rendezvous": free_port(), "draftRendezvous": free_port(),
                      "health": free_port(), "metrics": free_port(), "grpc": free_port(),
                      **(ports or {})}
        plan = json.loads(json.dumps(plan))
        plan["spec"]["ports"] = self.ports
        plan["spec"]["socketDir"] = self.socket_dir
        # Never the default /var/cache: each agent gets a private warmup directory.
        warm = plan["spec"].setdefault("warmup", {})
        warm.setdefault("cacheDir", str(self.sock_root / "w"))
        self.warmup_dir = warm["cacheDir"]
        self.plan = plan
        self.plan_path = workdir / f"plan-{node}.json"
        self.plan_path.write_text(json.dumps(plan))
        self.env = {
            **os.environ,
            "WEIGHTCACHE_CACHE_NAME": plan["cache"],
            "WEIGHTCACHE_NAMESPACE": plan["namespace"],
            "NODE_NAME": node,
            "POD_IP": host,
            "POD_NAME": f"{plan['cache']}-agent-{node}",
            "WEIGHTCACHE_PLAN": str(self.plan_path),
            **(env or {}),
        }
        self.args = args or ["--backoff", "0.3"]
        self.log_path = workdir / f"agent-{node}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None

    # -- process ------------------------------------------------------------------------------
    def start(self) -> Agent:
        log = open(self.log_path, "ab")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache.cli", "agent", *self.args], env=self.env,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        return self

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM first: the agent stops its daemons; SIGKILL only if it hangs.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.sock_root, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- APIs ---------------------------------------------------------------------------------
    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def metrics_target(self) -> str:
        return f"{self.host}:{self.ports['metrics']}"

    def stub(self) -> agent_pb2_grpc.AgentStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.grpc_target)
        return agent_pb2_grpc.AgentStub(self._channel)

    def channel(self) -> grpc.Channel:
        self.stub()
        assert self._channel is not None
        return self._channel

    def status(self) -> agent_pb2.StatusResponse:
        return self.stub().Status(agent_pb2.StatusRequest(), timeout=5)

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.metrics_target}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def wait(self, predicate: Callable[[agent_pb2.StatusResponse], bool],
             timeout: float = 60.0) -> agent_pb2.StatusResponse:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                last = self.status()
                if predicate(last):
                    return last
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"condition not met; last status {last}\n{self.log()[-4000:]}")

    def wait_ready(self, timeout: float = 60.0) -> agent_pb2.StatusResponse:
        return self.wait(lambda s: s.ready, timeout)
