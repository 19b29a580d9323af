"""Daemon runtimes the agent supervises, and their registry (looked up by the plan's `runtime`).

`base` is the seam (`Runtime`, `RankSpec`, `Probe`); `vllm` drives the official `vllm preload`
launcher, `native` this project's `weightcache preload`. May import: the agent's `config`,
`weightcache.contracts` and, for the native runtime, `weightcache.native`'s torch-free modules
(protocol, identity, security); never the operator, `bench` or `testing`, and never vLLM
itself (a vllm runtime only starts vLLM's launcher as a child).
"""

from __future__ import annotations

import importlib

from weightcache.agent.config import AgentConfig, ConfigError
from weightcache.agent.runtimes.base import Probe, RankSpec, Runtime

# name -> "module:Class"; imported lazily so one runtime's dependencies never load the other's.
REGISTRY: dict[str, str] = {
    "vllm": "weightcache.agent.runtimes.vllm:VllmRuntime",
    "native": "weightcache.agent.runtimes.native:NativeRuntime",
}


def get_runtime(cfg: AgentConfig) -> Runtime:
    target = REGISTRY.get(cfg.plan.runtime)
    if target is None:
        raise ConfigError(f"unknown runtime {cfg.plan.runtime!r}; known: {', '.join(REGISTRY)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(cfg)


__all__ = ["REGISTRY", "Probe", "RankSpec", "Runtime", "get_runtime"]
