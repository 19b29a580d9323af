"""One real webhook stack (kopf operator + kmock API + HTTPS on 127.0.0.1) for the module."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from weightcache.testing.webhook import LocalWebhook

_names = itertools.count()


@pytest.fixture(scope="session")
def webhook() -> Iterator[LocalWebhook]:
    with LocalWebhook() as hook:
        yield hook


def cache_obj(runtime: str = "vllm", phase: str = "Ready", **spec: Any) -> dict[str, Any]:
    """A WeightCache as stored in the API, with a fresh name so tests never share one."""
    name = spec.pop("name", None) or f"llama-{next(_names)}"
    body: dict[str, Any] = {"runtime": runtime, "model": {"path": "/models/llama-3.1-8b"}}
    if runtime == "vllm":
        body["image"] = "vllm/vllm-openai:v0.31.0"
    body.update(spec)
    return {
        "apiVersion": "weightcache.io/v1alpha1",
        "kind": "WeightCache",
        "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}"},
        "spec": body,
        "status": {"phase": phase},
    }


@pytest.fixture
def make_cache(webhook: LocalWebhook) -> Any:
    def make(runtime: str = "vllm", phase: str = "Ready", **spec: Any) -> dict[str, Any]:
        obj = cache_obj(runtime, phase, **spec)
        webhook.put_cache(obj)
        return obj

    return make
