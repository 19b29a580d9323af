"""Realistic engine pods as the API server hands them to a mutating webhook."""

from __future__ import annotations

import copy
from typing import Any

IMAGE = "vllm/vllm-openai:v0.31.0"


def _pod(name: str, containers: list[dict[str, Any]], cache: str | None, **extra: Any) -> dict:
    meta: dict[str, Any] = {
        "generateName": f"{name}-",
        "namespace": "serving",
        "labels": {"app": name},
        "annotations": {} if cache is None else {"weightcache.io/cache": cache},
    }
    meta.update(extra.pop("metadata", {}))
    spec: dict[str, Any] = {
        "containers": containers,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "schedulerName": "default-scheduler",
    }
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _engine(name: str = "vllm", **fields: Any) -> dict[str, Any]:
    c = {
        "name": name,
        "image": IMAGE,
        "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "terminationMessagePath": "/dev/termination-log",
        "imagePullPolicy": "IfNotPresent",
    }
    c.update(fields)
    return c


MODELS = {"name": "models", "hostPath": {"path": "/models", "type": "Directory"}}


def deployment_pod(cache: str | None) -> dict:
    """A Deployment's pod using the image's entrypoint with only flags in args."""
    pod = _pod(
        "llama-engine",
        [_engine(args=["--model", "/models/llama-3.1-8b", "--port", "8000"])],
        cache,
        volumes=[MODELS],
    )
    pod["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "llama-engine-7d9c",
            "uid": "rs1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return pod


def serve_args_pod(cache: str | None, *extra: str) -> dict:
    """`vllm serve` spelled out in args (command empty)."""
    return _pod(
        "serve-args",
        [_engine(args=["vllm", "serve", "/models/llama-3.1-8b", "--port=8000", *extra])],
        cache,
        volumes=[MODELS],
    )


def api_server_command_pod(cache: str | None, *extra: str) -> dict:
    """`python -m vllm.entrypoints.openai.api_server` in command, flags in args."""
    return _pod(
        "api-server",
        [
            _engine(
                command=["python3", "-m", "vllm.entrypoints.openai.api_server"],
                args=["--model", "/models/llama-3.1-8b", "--tensor-parallel-size", "1", *extra],
            )
        ],
        cache,
        volumes=[MODELS],
    )


def shell_pod(cache: str | None, script: str | None = None) -> dict:
    """A shell `-c` script that prepares things and then execs vLLM."""
    script = script or (
        "set -e; nvidia-smi -L; exec vllm serve /models/llama-3.1-8b "
        "--port 8000 --max-model-len 8192 && echo done"
    )
    return _pod(
        "shell", [_engine(command=["/bin/bash", "-c"], args=[script])], cache, volumes=[MODELS]
    )


def multi_container_pod(cache: str | None) -> dict:
    """A log-shipping sidecar first, the engine second, an init container."""
    sidecar = {
        "name": "fluent-bit",
        "image": "fluent/fluent-bit:3.1",
        "args": ["-c", "/fluent-bit/etc/fluent-bit.conf"],
        "securityContext": {"runAsUser": 0},
    }
    engine = _engine(command=["vllm", "serve"], args=["/models/llama-3.1-8b", "--port", "8000"])
    return _pod(
        "multi",
        [sidecar, engine],
        cache,
        volumes=[MODELS],
        initContainers=[{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
    )


def lws_pods(cache: str | None) -> tuple[dict, dict]:
    """LeaderWorkerSet leader and worker of a 2-node group (vLLM's Ray example shape)."""
    leader_script = (
        "bash /vllm-workspace/examples/online_serving/multi-node-serving.sh leader "
        "--ray_cluster_size=$(LWS_GROUP_SIZE); "
        "python3 -m vllm.entrypoints.openai.api_server --port 8080 "
        "--model /models/llama-3.1-8b --tensor-parallel-size 16"
    )
    worker_script = (
        "bash /vllm-workspace/examples/online_serving/multi-node-serving.sh worker "
        "--ray_address=$(LWS_LEADER_ADDRESS)"
    )
    labels = {
        "leaderworkerset.sigs.k8s.io/name": "llama",
        "leaderworkerset.sigs.k8s.io/group-index": "0",
    }
    leader = _pod(
        "llama-lws",
        [
            _engine(
                command=["sh", "-c", leader_script], resources={"limits": {"nvidia.com/gpu": "8"}}
            )
        ],
        cache,
        volumes=[MODELS, {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        metadata={"labels": {**labels, "leaderworkerset.sigs.k8s.io/worker-index": "0"}},
    )
    leader["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "dshm", "mountPath": "/dev/shm"}
    )
    worker = _pod(
        "llama-lws-0",
        [
            _engine(
                command=["sh", "-c", worker_script], resources={"limits": {"nvidia.com/gpu": "8"}}
            )
        ],
        cache,
        volumes=[MODELS],
        metadata={"labels": {**labels, "leaderworkerset.sigs.k8s.io/worker-index": "1"}},
    )
    return leader, worker


def native_pod(cache: str | None) -> dict:
    """A PyTorch consumer of the native client library (no vLLM)."""
    return _pod(
        "trainer",
        [
            _engine(
                name="torch",
                image="ghcr.io/example/eval:1.4",
                command=["python", "-m", "eval.run"],
                args=["--checkpoint", "/models/llama-3.1-8b"],
                env=[{"name": "PYTHONUNBUFFERED", "value": "1"}],
            )
        ],
        cache,
        volumes=[MODELS],
    )


def clone(pod: dict) -> dict:
    return copy.deepcopy(pod)
