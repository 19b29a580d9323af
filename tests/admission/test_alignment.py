"""GPU alignment through the mutating webhook (real HTTPS AdmissionReview), then run for real.

The last test takes the environment the webhook returned, adds what the kubelet and the
device plugin add (the downward-API POD_NAME, NVIDIA_VISIBLE_DEVICES with the allocated
UUIDs), and starts an interpreter against files the agent published: what vLLM's worker
would use as cuda:0 and cuda:1 is then checked against the map.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.admission import pods
from tests.admission.test_inject import admit
from tests.alignment.test_engine_start import Node
from weightcache.contracts import alignment as al
from weightcache.testing.webhook import LocalWebhook


def env_of(pod: dict, container: int = 0) -> dict[str, Any]:
    return {e["name"]: e for e in pod["spec"]["containers"][container].get("env") or []}


def socket_dir(cache: dict) -> str:
    return f"/var/run/weightcache/serving/{cache['metadata']['name']}"


def test_tp2_engine_gets_alignment_env(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(parallelism={"tensor": 2})
    pod = pods.api_server_command_pod(cache["metadata"]["name"])
    pod["spec"]["containers"][0]["args"][3] = "2"  # --tensor-parallel-size 2
    out, patched = admit(webhook, pod)
    assert out["allowed"] is True and "warnings" not in out
    env = env_of(patched)
    assert env[al.ENV_TP]["value"] == "2" and env[al.ENV_DP_LOCAL]["value"] == "1"
    assert env[al.ENV_SOCKET_DIR]["value"] == socket_dir(cache)
    assert env["PYTHONPATH"]["value"] == f"{socket_dir(cache)}/python"
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert al.ENV_DP_START not in env
    # The command line is untouched: alignment rides on the interpreter, not the argv.
    assert patched["spec"]["containers"][0]["command"] == pod["spec"]["containers"][0]["command"]
    again, _ = admit(webhook, patched)
    assert "patch" not in again  # re-admission changes nothing


def test_shell_script_with_existing_pythonpath(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(parallelism={"tensor": 4})
    pod = pods.shell_pod(cache["metadata"]["name"],
                         "exec vllm serve /models/llama-3.1-8b -tp 4 --enable-expert-parallel")
    pod["spec"]["containers"][0]["env"] = [{"name": "PYTHONPATH", "value": "/opt/extra"}]
    _, patched = admit(webhook, pod)
    env = env_of(patched)
    assert env["PYTHONPATH"]["value"] == f"{socket_dir(cache)}/python:/opt/extra"
    assert env[al.ENV_TP]["value"] == "4" and env[al.ENV_DP_START]["value"] == "0"


def test_no_alignment_where_it_cannot_help_or_would_override(
    webhook: LocalWebhook, make_cache: Any
) -> None:
    tp1 = make_cache()
    _, patched = admit(webhook, pods.deployment_pod(tp1["metadata"]["name"]))
    assert al.ENV_TP not in env_of(patched)  # TP=1 hits on any GPU
    tp2 = make_cache(parallelism={"tensor": 2})
    pod = pods.api_server_command_pod(tp2["metadata"]["name"])
    pod["spec"]["containers"][0]["args"][3] = "2"
    pod["spec"]["containers"][0]["env"] = [{"name": "CUDA_VISIBLE_DEVICES", "value": "1,0"}]
    out, patched = admit(webhook, pod)
    assert al.ENV_TP not in env_of(patched)
    assert any("sets CUDA_VISIBLE_DEVICES" in w for w in out["warnings"])
    pod["spec"]["containers"][0]["env"] = [
        {"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]
    out, patched = admit(webhook, pod)
    assert al.ENV_TP not in env_of(patched)
    assert any("PYTHONPATH from valueFrom" in w for w in out["warnings"])


def test_admitted_env_aligns_a_real_interpreter(webhook: LocalWebhook, make_cache: Any) -> None:
    root = tempfile.mkdtemp(prefix="wcw", dir="/tmp")
    node = Node(Path(root), tp=2)
    try:
        cache = make_cache(parallelism={"tensor": 2}, socketDir=node.socket_dir)
        pod = pods.serve_args_pod(cache["metadata"]["name"], "--tensor-parallel-size", "2")
        _, patched = admit(webhook, pod)
        node.publish()
        env = {k: e["value"] for k, e in env_of(patched).items() if "value" in e}
        env.update(PATH=os.environ["PATH"], POD_NAME="serve-args-x1", TMPDIR=root,
                   NVIDIA_VISIBLE_DEVICES=f"{node.ids[3]},{node.ids[6]}")
        out = os.path.join(root, "seen.json")
        probe = ("import json, os, sys; order = os.environ['CUDA_VISIBLE_DEVICES'].split(',');"
                 "json.dump(order, open(sys.argv[1], 'w'))")
        subprocess.run([sys.executable, "-c", probe, out], env=env, check=True, timeout=60)
        order = json.loads(Path(out).read_text())
        gpu_map = al.read_map(node.socket_dir)
        # vLLM: logical device i (= local rank i, DP 1) is the i-th entry.
        assert [gpu_map.gpus[order[i]].tp_rank for i in range(2)] == [0, 1]
        assert node.wait_reports(1)["aligned"] == 1
    finally:
        node.reports.stop()
        shutil.rmtree(root, ignore_errors=True)
