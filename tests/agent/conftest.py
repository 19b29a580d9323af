"""Fixtures of the node agent tests: a tiny checkpoint, agent processes, a Prometheus server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import Agent, fake_vllm_bin
from tests.agent.prom import PromServer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightcache.testing.checkpoints import TINY, write_llama_checkpoint

    return write_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY)


@pytest.fixture
def vllm_bin(tmp_path: Path) -> str:
    return fake_vllm_bin(tmp_path)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Any]:
    started: list[Agent] = []

    def make(plan: dict[str, Any], **kw: Any) -> Agent:
        agent = Agent(tmp_path, plan, **kw)
        started.append(agent)
        return agent

    yield make
    for agent in started:
        agent.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    """Factory: `prometheus(targets)` starts a real Prometheus scraping them every second."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (make prometheus)")
    servers: list[PromServer] = []

    def make(targets: list[str], **kw: Any) -> PromServer:
        server = PromServer(tmp_path / f"prom{len(servers)}", targets, **kw).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
