"""Webhook configurations, command-line settings, and the command-line parsing of engines."""

from __future__ import annotations

import argparse

import pytest

from weightcache.operator import admission, imageref
from weightcache.operator.admission import cmdline, inject
from weightcache.operator.admission.config import AdmissionConfig


def test_configurations_never_block_pods_and_see_only_opted_in_ones() -> None:
    cfg = AdmissionConfig(namespace="wc-system")
    (hook,) = admission.mutating_configuration(cfg, "Q0E=")["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["timeoutSeconds"] == 5
    assert hook["sideEffects"] == "NoneOnDryRun"
    assert hook["rules"][0]["operations"] == ["CREATE"]
    assert hook["rules"][0]["resources"] == ["pods"]
    assert hook["clientConfig"] == {
        "service": {
            "name": "weightcache-webhook",
            "namespace": "wc-system",
            "path": "/inject-pod",
            "port": 443,
        },
        "caBundle": "Q0E=",
    }
    (cond,) = hook["matchConditions"]
    assert "'weightcache.io/cache' in object.metadata.annotations" in cond["expression"]
    ns = hook["namespaceSelector"]["matchExpressions"]
    assert {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "wc-system"],
    } in ns
    obj = hook["objectSelector"]["matchExpressions"][0]
    assert obj["operator"] == "NotIn" and "weightcache-agent" in obj["values"]

    (vhook,) = admission.validating_configuration(cfg, None)["webhooks"]
    assert vhook["rules"][0] == {
        "apiGroups": ["weightcache.io"],
        "apiVersions": ["v1alpha1"],
        "resources": ["weightcaches"],
        "operations": ["CREATE", "UPDATE"],
        "scope": "Namespaced",
    }
    assert vhook["clientConfig"]["service"]["path"] == "/validate-weightcache"
    assert "caBundle" not in vhook["clientConfig"]


def test_command_line_settings() -> None:
    p = argparse.ArgumentParser()
    admission.add_arguments(p)
    cfg = AdmissionConfig.from_args(
        p.parse_args(
            [
                "--webhook-namespace",
                "ops",
                "--webhook-cert-mode",
                "cert-manager",
                "--webhook-cert-dir",
                "/certs",
                "--webhook-timeout",
                "3",
                "--webhook-unmanaged",
            ]
        )
    )
    assert (cfg.namespace, cfg.cert_mode, cfg.cert_dir, cfg.timeout_seconds) == (
        "ops",
        "cert-manager",
        "/certs",
        3,
    )
    assert cfg.manage_configurations is False and cfg.enabled is True
    assert "weightcache-webhook.ops.svc" in cfg.dns_names()
    assert AdmissionConfig.from_args(p.parse_args(["--webhook-disabled"])).enabled is False


@pytest.mark.parametrize(
    ("container", "kind"),
    [
        ({"args": ["--model", "m"]}, "entrypoint"),
        ({}, "entrypoint"),
        ({"command": ["vllm", "serve", "m"]}, "list"),
        ({"command": ["/usr/local/bin/vllm"], "args": ["serve", "m"]}, "list"),
        ({"command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}, "list"),
        ({"command": ["sh", "-c", "exec vllm serve m"]}, "shell"),
        (
            {"command": ["bash"], "args": ["-ec", "python3 -m vllm.entrypoints.openai.api_server"]},
            "shell",
        ),
        ({"command": ["sh", "-c", "ray start --block"]}, "none"),
        ({"command": ["python", "train.py"]}, "none"),
    ],
)
def test_argv_kinds(container: dict, kind: str) -> None:
    assert cmdline.parse_argv(container).kind == kind


def test_flag_forms() -> None:
    tokens = ["vllm", "serve", "m", "--dtype=bfloat16", "-tp", "4", "--load_format", "auto"]
    assert cmdline.flag_values(tokens, "--dtype") == ["bfloat16"]
    assert cmdline.flag_values(tokens, "--tensor-parallel-size", "-tp") == ["4"]
    assert cmdline.flag_values(tokens, "--load-format") == ["auto"]
    assert cmdline.model_arg(tokens) == "m"
    assert cmdline.model_arg(["python", "-m", "x", "--model=/m"]) == "/m"


@pytest.mark.parametrize(
    ("a", "b", "differ"),
    [
        ("vllm/vllm-openai:v0.31.0", "docker.io/vllm/vllm-openai:v0.31.0", False),
        ("ubuntu", "docker.io/library/ubuntu:latest", False),
        ("vllm/vllm-openai:v0.31.0", "vllm/vllm-openai:v0.31.1", True),
        ("reg.local:5000/vllm:1", "reg.local:5000/vllm:1", False),
        ("vllm/vllm-openai@sha256:" + "a" * 64, "other/x:1@sha256:" + "a" * 64, False),
    ],
)
def test_image_comparison(a: str, b: str, differ: bool) -> None:
    assert imageref.differ(a, b) is differ


def test_isolation_table_covers_every_runtime() -> None:
    from weightcache.operator.spec import RUNTIMES

    assert set(inject.ISOLATION) == set(RUNTIMES)
    assert inject.ISOLATION["vllm"].host_ipc and not inject.ISOLATION["native"].host_ipc


def test_the_operator_command_line_carries_the_webhook_flags() -> None:
    from weightcache.operator import main

    args = main.parser().parse_args(
        [
            "--webhook-namespace",
            "ops",
            "--webhook-url",
            "https://wc.example:9443",
            "--webhook-port",
            "9555",
        ]
    )
    cfg = AdmissionConfig.from_args(args)
    assert (cfg.namespace, cfg.port, cfg.url) == ("ops", 9555, "https://wc.example:9443")
    assert "wc.example" in cfg.dns_names()
    (hook,) = admission.mutating_configuration(cfg, None)["webhooks"]
    assert hook["clientConfig"] == {"url": "https://wc.example:9443/inject-pod"}


def test_shell_words_split_at_operators() -> None:
    script = "echo 'a b' && exec vllm serve /m --dtype bfloat16; # --dtype float16"
    argv = cmdline.parse_argv({"command": ["sh", "-c", script]})
    assert argv.kind == "shell"
    # the vLLM command's own words: not the echo before it, not the comment after it
    assert argv.tokens == ["vllm", "serve", "/m", "--dtype", "bfloat16"]
    assert cmdline.flag_values(argv.tokens, "--dtype") == ["bfloat16"]


@pytest.mark.parametrize("runtime", ["vllm", "native"])
def test_patch_ops_reproduce_the_injected_pod(runtime: str) -> None:
    """The coarse ops must carry every change the injectors make, for every pod shape."""
    from tests.admission import pods
    from tests.admission.conftest import cache_obj

    cache = cache_obj(runtime, name="c")
    leader, worker = pods.lws_pods("c")
    shapes = [
        pods.deployment_pod("c"),
        pods.serve_args_pod("c"),
        pods.api_server_command_pod("c"),
        pods.shell_pod("c"),
        pods.multi_container_pod("c"),
        leader,
        worker,
        pods.native_pod("c"),
    ]
    # Native engines are found by annotation or position: name the engine of the sidecar pod.
    shapes[4]["metadata"]["annotations"]["weightcache.io/container"] = "vllm"
    for pod in shapes:
        res = inject.inject(pod, cache)
        assert res.ops and res.pod is not pod
        assert inject.apply_ops(pod, res.ops) == res.pod
        assert inject.inject(res.pod, cache).ops == []
