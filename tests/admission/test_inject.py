"""Mutating webhook over real HTTPS: AdmissionReview in, JSONPatch out, applied and checked."""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

import jsonpatch
import pytest

from tests.admission import pods
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import warmup
from weightcache.testing.webhook import LocalWebhook, decode_patch

SOCKETS = "weightcache-sockets"


def admit(webhook: LocalWebhook, pod: dict, **kw: Any) -> tuple[dict, dict]:
    """Send the pod; return (response payload, pod with the returned patch applied)."""
    out = webhook.review(pod, **kw)["response"]
    patched = jsonpatch.apply_patch(pod, decode_patch({"response": out}))
    return out, patched


def loader_config(tokens: list[str]) -> dict:
    i = tokens.index("--model-loader-extra-config")
    return json.loads(tokens[i + 1])


def assert_common(pod: dict, cache: dict, container: int = 0, read_only: bool = False) -> None:
    name, ns = cache["metadata"]["name"], cache["metadata"]["namespace"]
    socket_dir = f"/var/run/weightcache/{ns}/{name}"
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["weightcache.io/injected"] == name
    vol = [v for v in spec["volumes"] if v["name"] == SOCKETS]
    assert vol == [{"name": SOCKETS, "hostPath": {"path": socket_dir, "type": "Directory"}}]
    c = spec["containers"][container]
    mounts = [m for m in c["volumeMounts"] if m["name"] == SOCKETS]
    want = {"name": SOCKETS, "mountPath": socket_dir}
    if read_only:
        want["readOnly"] = True
    assert mounts == [want]
    assert c["securityContext"]["runAsUser"] == 1000
    assert c["securityContext"]["runAsGroup"] == 1000
    # The warmup directory, read-write at the same path (docs/warmup.md).
    warm = f"/var/cache/weightcache/{ns}/{name}"
    assert [v for v in spec["volumes"] if v["name"] == "weightcache-warmup"] == [
        {"name": "weightcache-warmup", "hostPath": {"path": warm, "type": "Directory"}}]
    assert [m for m in c["volumeMounts"] if m["name"] == "weightcache-warmup"] == [
        {"name": "weightcache-warmup", "mountPath": warm}]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    key = f"{ns}.cache.weightcache.io/{name}"
    expr = {"key": key, "operator": "In", "values": ["ready", "loading"]}
    assert terms and all(expr in t["matchExpressions"] for t in terms)
    preferred = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    ready = {"weight": 100, "preference": {"matchExpressions": [
        {"key": key, "operator": "In", "values": ["ready"]}]}}
    assert preferred.count(ready) == 1


def test_deployment_pod_entrypoint_args(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.deployment_pod(cache["metadata"]["name"])
    out, patched = admit(webhook, pod)
    assert out["allowed"] is True
    assert_common(patched, cache)
    c = patched["spec"]["containers"][0]
    assert c["args"][:4] == ["--model", "/models/llama-3.1-8b", "--port", "8000"]
    assert c["args"][4:6] == ["--load-format", "ipc_cache"]
    cfg = loader_config(c["args"])
    assert cfg == {
        "socket_dir": f"/var/run/weightcache/serving/{cache['metadata']['name']}",
        "mode": "zero_copy",
        "fallback": True,
        "connect_timeout_s": 5.0,
        "state_timeout_s": 300.0,
    }
    assert patched["spec"]["hostIPC"] is True
    assert "hostPID" not in patched["spec"]
    assert "command" not in c
    # Everything the user wrote is still there.
    assert c["volumeMounts"][0] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert patched["metadata"]["ownerReferences"] == pod["metadata"]["ownerReferences"]
    assert "warnings" not in out


def test_vllm_serve_in_args(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    _out, patched = admit(webhook, pod)
    assert_common(patched, cache)
    args = patched["spec"]["containers"][0]["args"]
    assert args[:4] == ["vllm", "serve", "/models/llama-3.1-8b", "--port=8000"]
    assert args[4:6] == ["--load-format", "ipc_cache"]
    assert loader_config(args)["mode"] == "zero_copy"


def test_api_server_module_in_command(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.api_server_command_pod(cache["metadata"]["name"])
    _out, patched = admit(webhook, pod)
    assert_common(patched, cache)
    c = patched["spec"]["containers"][0]
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert c["args"][-4:-2] == ["--load-format", "ipc_cache"]
    assert loader_config(c["args"])["socket_dir"].endswith(cache["metadata"]["name"])


def test_shell_c_script_is_edited_in_place(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.shell_pod(cache["metadata"]["name"])
    _out, patched = admit(webhook, pod)
    assert_common(patched, cache)
    c = patched["spec"]["containers"][0]
    assert c["command"] == ["/bin/bash", "-c"]
    script = c["args"][0]
    assert script.startswith(
        "set -e; nvidia-smi -L; exec vllm serve /models/llama-3.1-8b --port 8000 "
        "--max-model-len 8192 --load-format ipc_cache "
    )
    assert script.endswith("' && echo done")
    # The flags sit inside the vLLM command (before `&&`) and survive shell word splitting.
    tokens = shlex.split(script.split("&&")[0])
    assert tokens[tokens.index("--load-format") + 1] == "ipc_cache"
    assert loader_config(tokens)["fallback"] is True


def test_multi_container_targets_the_engine(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.multi_container_pod(cache["metadata"]["name"])
    _out, patched = admit(webhook, pod)
    assert_common(patched, cache, container=1)
    sidecar, engine = patched["spec"]["containers"]
    assert sidecar == pod["spec"]["containers"][0]  # untouched, even its runAsUser 0
    assert engine["args"][3:5] == ["--load-format", "ipc_cache"]
    assert patched["spec"]["initContainers"] == pod["spec"]["initContainers"]


def test_container_annotation_picks_the_engine(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(runtime="native")
    pod = pods.multi_container_pod(cache["metadata"]["name"])
    pod["metadata"]["annotations"]["weightcache.io/container"] = "vllm"
    _out, patched = admit(webhook, pod)
    engine = patched["spec"]["containers"][1]
    assert {e["name"] for e in engine["env"]} >= {"WEIGHTCACHE_SOCKET_DIR", "WEIGHTCACHE_CACHE"}
    assert "env" not in patched["spec"]["containers"][0]


def test_lws_leader_and_worker(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(parallelism={"tensor": 16, "nodes": 2}, gpusPerNode=8)
    leader, worker = pods.lws_pods(cache["metadata"]["name"])
    out, patched = admit(webhook, leader)
    assert_common(patched, cache)
    script = patched["spec"]["containers"][0]["command"][2]
    head, _, tail = script.partition("python3 -m vllm.entrypoints.openai.api_server ")
    assert "multi-node-serving.sh leader" in head
    # The flags follow the command's last word, so they stay inside that command.
    assert tail.startswith("--port 8080 --model /models/llama-3.1-8b --tensor-parallel-size 16 ")
    assert "--tensor-parallel-size 16 --load-format ipc_cache --model-loader-extra-config " in tail
    # The leader mounts a private /dev/shm, which hides the host's: a warning, not a denial.
    assert any("/dev/shm" in w for w in out["warnings"])

    out, patched = admit(webhook, worker)
    assert_common(patched, cache)
    assert patched["spec"]["containers"][0]["command"] == worker["spec"]["containers"][0]["command"]
    assert "args" not in patched["spec"]["containers"][0]
    assert patched["spec"]["hostIPC"] is True
    assert any("does not run vLLM's server" in w for w in out["warnings"])


def test_runtime_native_gets_env_not_flags(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(runtime="native", engine={"mode": "copy", "connectTimeoutSeconds": 2})
    name = cache["metadata"]["name"]
    pod = pods.native_pod(name)
    _out, patched = admit(webhook, pod)
    assert_common(patched, cache, read_only=True)
    c = patched["spec"]["containers"][0]
    assert c["args"] == ["--checkpoint", "/models/llama-3.1-8b"]
    env = {e["name"]: e["value"] for e in c["env"]}
    warm = warmup.identity_dir(WeightCacheSpec.from_object(cache), cache["metadata"]["uid"])
    assert warm.startswith(f"/var/cache/weightcache/serving/{name}/")
    assert env == {
        "PYTHONUNBUFFERED": "1",
        "WEIGHTCACHE_SOCKET_DIR": f"/var/run/weightcache/serving/{name}",
        "WEIGHTCACHE_MODE": "copy",
        "WEIGHTCACHE_FALLBACK": "true",
        "WEIGHTCACHE_CONNECT_TIMEOUT_S": "2",
        "WEIGHTCACHE_STATE_TIMEOUT_S": "300",
        "WEIGHTCACHE_CACHE": name,
        # torch's compile caches in the cache's warmup directory (docs/warmup.md)
        "TORCHINDUCTOR_CACHE_DIR": f"{warm}/inductor",
        "TRITON_CACHE_DIR": f"{warm}/triton",
        "WEIGHTCACHE_COMPILE_DIR": f"{warm}/torch",
    }
    assert "hostIPC" not in patched["spec"]  # the VMM/memfd path needs only the socket dir


def test_annotation_overrides_mode_and_fallback(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    pod["metadata"]["annotations"].update(
        {"weightcache.io/mode": "copy", "weightcache.io/fallback": "false"}
    )
    _, patched = admit(webhook, pod)
    cfg = loader_config(patched["spec"]["containers"][0]["args"])
    assert (cfg["mode"], cfg["fallback"]) == ("copy", False)


def test_existing_affinity_terms_all_get_the_ready_label(
    webhook: LocalWebhook, make_cache: Any
) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    gpu_a = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
    gpu_b = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [gpu_a, gpu_b]}
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    _, patched = admit(webhook, pod)
    assert_common(patched, cache)
    terms = patched["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0] for t in terms] == [
        gpu_a["matchExpressions"][0],
        gpu_b["matchExpressions"][0],
    ]
    assert all(len(t["matchExpressions"]) == 2 for t in terms)
    assert (
        patched["spec"]["affinity"]["podAntiAffinity"] == pod["spec"]["affinity"]["podAntiAffinity"]
    )


def test_affinity_accepts_loading_nodes_prefers_ready_and_passes_api_rules(
    webhook: LocalWebhook, make_cache: Any
) -> None:
    """Scale-up overlaps: required `In [ready, loading]`, preferred `ready` (weight 100), kept
    beside a user's own preferences, in the shape a real API server accepts; a pod's own
    `In [ready]` on the key is kept (ANDed: that pod still waits for a ready node)."""
    from weightcache.testing import apirules

    cache = make_cache()
    name, ns = cache["metadata"]["name"], cache["metadata"]["namespace"]
    key = f"{ns}.cache.weightcache.io/{name}"
    pod = pods.serve_args_pod(name)
    own = {"weight": 5, "preference": {"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}}
    old = {"key": key, "operator": "In", "values": ["ready"]}
    pod["spec"]["affinity"] = {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [own],
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [old]}]}}}
    _, patched = admit(webhook, pod)
    assert_common(patched, cache)
    node = patched["spec"]["affinity"]["nodeAffinity"]
    assert node["preferredDuringSchedulingIgnoredDuringExecution"][0] == own
    exprs = node["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]
    assert exprs == [old, {"key": key, "operator": "In", "values": ["ready", "loading"]}]
    obj = {"apiVersion": "v1", "kind": "Pod", **patched}
    obj["metadata"] = {**patched["metadata"], "name": "engine", "namespace": ns}
    problems = [p for p in apirules.check(obj) if p.rule.startswith("pod.affinity")]
    assert problems == []
    # The rules bite: a weight out of range and a bad label value are what a server refuses.
    node["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] = 101
    exprs[1]["values"] = ["ready", "not a value!"]
    rules = {p.rule for p in apirules.check(obj)}
    assert {"pod.affinity.preferred", "pod.affinity.terms"} <= rules


@pytest.mark.parametrize(
    "make_pod",
    [
        pods.deployment_pod,
        pods.serve_args_pod,
        pods.api_server_command_pod,
        pods.shell_pod,
        pods.multi_container_pod,
        lambda c: pods.lws_pods(c)[0],
        lambda c: pods.lws_pods(c)[1],
        pods.native_pod,
    ],
    ids=[
        "deployment",
        "serve-args",
        "api-server",
        "shell",
        "multi",
        "lws-leader",
        "lws-worker",
        "native",
    ],
)
def test_idempotent(webhook: LocalWebhook, make_cache: Any, make_pod: Any) -> None:
    runtime = "native" if make_pod is pods.native_pod else "vllm"
    cache = make_cache(runtime=runtime)
    _, once = admit(webhook, make_pod(cache["metadata"]["name"]))
    out, twice = admit(webhook, once)
    assert "patch" not in out
    assert twice == once


def test_user_set_ipc_cache_is_kept(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"], "--load-format", "ipc_cache")
    _, patched = admit(webhook, pod)
    args = patched["spec"]["containers"][0]["args"]
    assert args.count("--load-format") == 1
    assert "--model-loader-extra-config" in args


def test_not_opted_in_pod_is_untouched(webhook: LocalWebhook) -> None:
    out, _patched = admit(webhook, pods.serve_args_pod(None))
    assert out["allowed"] is True and "patch" not in out and "warnings" not in out


def test_unknown_cache_allows_unchanged_with_warning(webhook: LocalWebhook) -> None:
    pod = pods.serve_args_pod("no-such-cache")
    out, patched = admit(webhook, pod)
    assert out["allowed"] is True
    assert "patch" not in out
    assert patched == pod
    assert out["warnings"] == [
        "WeightCache 'no-such-cache' not found in this namespace: the pod is admitted "
        "unchanged and loads its weights from disk"
    ]


# ------------------------------------------------------------------------------ denials


def denial(webhook: LocalWebhook, pod: dict) -> str:
    out = webhook.review(pod)["response"]
    assert out["allowed"] is False
    assert "patch" not in out
    assert out["status"]["code"] == 403
    return out["status"]["message"]


def test_conflicting_load_format_denied(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    msg = denial(
        webhook, pods.serve_args_pod(cache["metadata"]["name"], "--load-format=safetensors")
    )
    assert "container 'vllm' sets --load-format safetensors" in msg
    assert "--load-format ipc_cache" in msg
    msg = denial(
        webhook, pods.api_server_command_pod(cache["metadata"]["name"], "--load_format", "dummy")
    )
    assert "sets --load-format dummy" in msg


def test_conflicting_uid_denied(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(runAs={"uid": 2000, "gid": 2000})
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    pod["spec"]["securityContext"] = {"runAsUser": 0, "fsGroup": 1000}
    msg = denial(webhook, pod)
    assert "runs as uid 0 (the pod's securityContext.runAsUser)" in msg
    assert "set it to 2000" in msg
    # The container's own setting wins over the pod's: a matching one is accepted.
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 2000}
    out, patched = admit(webhook, pod)
    assert out["allowed"] is True
    assert patched["spec"]["containers"][0]["securityContext"] == {
        "runAsUser": 2000,
        "runAsGroup": 2000,
    }


def test_matching_pod_uid_is_left_alone(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    pod["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000}
    _, patched = admit(webhook, pod)
    assert "securityContext" not in patched["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("annotation", "value", "expected"),
    [
        (
            "weightcache.io/container",
            "engine",
            "names no container of this pod (containers: 'vllm')",
        ),
        ("weightcache.io/mode", "shared", "is not a cache mode; use one of zero_copy, copy"),
        ("weightcache.io/fallback", "maybe", 'must be "true" or "false"'),
    ],
)
def test_bad_annotations_denied(
    webhook: LocalWebhook, make_cache: Any, annotation: str, value: str, expected: str
) -> None:
    cache = make_cache()
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    pod["metadata"]["annotations"][annotation] = value
    assert expected in denial(webhook, pod)


def test_socket_dir_mount_collision_denied(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(socketDir="/var/run/wc")
    pod = pods.serve_args_pod(cache["metadata"]["name"])
    pod["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "models", "mountPath": "/var/run/wc"}
    )
    assert "already mounts volume 'models' at /var/run/wc" in denial(webhook, pod)


# ------------------------------------------------------------------------------ warnings


def test_mismatches_warn_and_post_an_event(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(parallelism={"tensor": 2}, engineArgs={"dtype": "bfloat16"})
    name = cache["metadata"]["name"]
    pod = pods.api_server_command_pod(name)
    pod["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.30.1"
    pod["spec"]["containers"][0]["args"][1] = "/models/qwen-7b"
    out, _patched = admit(webhook, pod)
    assert out["allowed"] is True and "patch" in out  # still injected: fallback stays possible
    text = "\n".join(out["warnings"])
    assert (
        "fingerprint field checkpoint: container 'vllm' has '/models/qwen-7b', the cache holds "
        "'/models/llama-3.1-8b'" in text
    )
    assert "fingerprint field tp_size: container 'vllm' has 1, the cache holds 2" in text
    # no --dtype is `auto`: vLLM reads the checkpoint's dtype, which the webhook cannot
    assert "could not check the dtype: container 'vllm' uses auto, cache '" + name in text
    assert "fingerprint field dtype" not in text
    assert (
        "fingerprint field vllm_version: container 'vllm' has image 'vllm/vllm-openai:v0.30.1', "
        "the cache holds image 'vllm/vllm-openai:v0.31.0'" in text
    )
    deadline = time.monotonic() + 5
    events: list[dict] = []
    while time.monotonic() < deadline and not events:
        events = [e for e in webhook.events("serving") if e["involvedObject"]["name"] == name]
        time.sleep(0.05)
    assert len(events) == 1
    ev = events[0]
    assert (ev["type"], ev["reason"]) == ("Warning", "EngineMismatch")
    assert ev["involvedObject"]["kind"] == "WeightCache"
    assert ev["message"].startswith("pod serving/api-server-*: ")
    assert "fingerprint field tp_size: container 'vllm' has 1, the cache holds 2" in ev["message"]
    assert "could not check" not in ev["message"]  # events carry differences only


def test_dry_run_posts_no_event(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(engineArgs={"dtype": "float16"})
    name = cache["metadata"]["name"]
    out = webhook.review(pods.serve_args_pod(name), dry_run=True)["response"]
    assert any("dtype" in w for w in out["warnings"])
    time.sleep(0.3)
    assert not [e for e in webhook.events("serving") if e["involvedObject"]["name"] == name]


def test_equivalent_image_references_do_not_warn(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(image="docker.io/vllm/vllm-openai:v0.31.0")
    out, _ = admit(webhook, pods.serve_args_pod(cache["metadata"]["name"]))
    assert "warnings" not in out


def test_cache_not_ready_warns(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache(phase="Loading")
    out, patched = admit(webhook, pods.serve_args_pod(cache["metadata"]["name"]))
    assert out["allowed"] is True
    assert_common(patched, cache)
    assert any("is not Ready yet (phase Loading)" in w for w in out["warnings"])


def test_index_serves_lookups_without_api_calls(webhook: LocalWebhook, make_cache: Any) -> None:
    cache = make_cache()
    name = cache["metadata"]["name"]
    path = f"/weightcaches/{name}"
    deadline = time.monotonic() + 5
    before = webhook.requests_to(path)
    # Once kopf's watch has indexed the cache, admissions make no API call for it.
    while time.monotonic() < deadline:
        before = webhook.requests_to(path)
        webhook.review(pods.serve_args_pod(name))
        if webhook.requests_to(path) == before:
            break
        time.sleep(0.05)
    for _ in range(5):
        webhook.review(pods.serve_args_pod(name))
    assert webhook.requests_to(path) == before


def test_metrics_count_results(webhook: LocalWebhook, make_cache: Any) -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    injected = value("weightcache_webhook_requests_total", webhook="inject-pod", result="injected")
    unknown = value(
        "weightcache_webhook_requests_total", webhook="inject-pod", result="unknown_cache"
    )
    timed = value("weightcache_webhook_duration_seconds_count", webhook="inject-pod")
    cache = make_cache()
    webhook.review(pods.serve_args_pod(cache["metadata"]["name"]))
    webhook.review(pods.serve_args_pod("missing"))
    assert (
        value("weightcache_webhook_requests_total", webhook="inject-pod", result="injected")
        == injected + 1
    )
    assert (
        value("weightcache_webhook_requests_total", webhook="inject-pod", result="unknown_cache")
        == unknown + 1
    )
    assert value("weightcache_webhook_duration_seconds_count", webhook="inject-pod") == timed + 2
    assert (
        value("weightcache_webhook_certificate_expiry_timestamp_seconds")
        > time.time() + 300 * 86400
    )


def test_index_miss_falls_back_to_one_get(webhook: LocalWebhook) -> None:
    """A cache the watch has not delivered (a standby replica, a cache created a moment ago)."""
    from tests.admission.conftest import cache_obj

    cache = cache_obj()
    name = cache["metadata"]["name"]
    # Stored without a watch event: kopf's index never hears of it.
    webhook.kmock.objects["weightcache.io/v1alpha1/weightcaches", "serving", name] = cache
    before = webhook.requests_to(f"/weightcaches/{name}")
    _out, patched = admit(webhook, pods.serve_args_pod(name))
    assert_common(patched, cache)
    assert webhook.requests_to(f"/weightcaches/{name}") == before + 1


def test_an_internal_failure_admits_the_pod_unchanged(webhook: LocalWebhook) -> None:
    """A bug or a corrupt object must not block pods: allowed, unchanged, with a warning."""
    from prometheus_client import REGISTRY

    from tests.admission.conftest import cache_obj

    cache = cache_obj(engine={"connectTimeoutSeconds": "soon"})  # not a number
    name = cache["metadata"]["name"]
    webhook.kmock.objects["weightcache.io/v1alpha1/weightcaches", "serving", name] = cache
    labels = {"webhook": "inject-pod", "result": "error"}
    errors = REGISTRY.get_sample_value("weightcache_webhook_requests_total", labels) or 0.0
    out = webhook.review(pods.serve_args_pod(name))["response"]
    assert out["allowed"] is True
    assert "patch" not in out
    assert out["warnings"][0].startswith("weightcache webhook failed (")
    assert REGISTRY.get_sample_value("weightcache_webhook_requests_total", labels) == errors + 1


@pytest.mark.parametrize("runtime", ["native", "vllm"])
def test_item6_injected_engines_need_privileged_for_both_runtimes(
    webhook: LocalWebhook, runtime: str
) -> None:
    """Item 6: the injected hostPath socket mount breaks Pod Security baseline for both runtimes.

    The pods are judged by the baseline checks of k8s.io/pod-security-admission (restated in
    weightcache.testing.apirules); a cache whose namespace enforces baseline makes the webhook
    say so in an admission warning.
    """
    from tests.admission.conftest import cache_obj
    from weightcache.testing import apirules

    cache = cache_obj(runtime=runtime)
    cache["status"]["podSecurity"] = "baseline"
    webhook.put_cache(cache)
    name = cache["metadata"]["name"]
    pod = pods.native_pod(name) if runtime == "native" else pods.deployment_pod(name)
    before = apirules.pod_security_violations(pod["spec"], "baseline")
    out, patched = admit(webhook, pod)
    assert out["allowed"] is True
    found = [v for v in apirules.pod_security_violations(patched["spec"], "baseline")
             if v not in before]  # fmt: skip
    assert f"hostPath volume {SOCKETS!r}" in found
    assert ("hostIPC=true" in found) is (runtime == "vllm")
    warning = next(w for w in out["warnings"] if "Pod Security" in w)
    assert "enforces Pod Security level 'baseline'" in warning
    assert "pod-security.kubernetes.io/enforce=privileged" in warning
    assert ("hostIPC" in warning) is (runtime == "vllm")


def test_no_pod_security_warning_in_privileged_namespaces(
    webhook: LocalWebhook, make_cache: Any
) -> None:
    cache = make_cache(runtime="native")
    out, _ = admit(webhook, pods.native_pod(cache["metadata"]["name"]))
    assert not any("Pod Security" in w for w in out.get("warnings") or [])
