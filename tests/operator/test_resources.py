"""Shapes of the owned objects that integration tests do not reach."""

from __future__ import annotations

import json

from weightcache import constants
from weightcache.api.v1alpha1 import WeightCacheSpec, with_defaults
from weightcache.operator import resources

CACHE = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}}


def _build(raw: dict, nodes=("n0",), options: resources.AgentOptions | None = None):
    spec = with_defaults(raw, "ml", "llama")
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    doc = resources.plan(CACHE, typed, list(nodes), epoch=3)
    options = options or resources.AgentOptions()
    return spec, doc, resources.daemonset(CACHE, doc.spec, doc, list(nodes), options)


def test_replicas_are_planned_as_vllm_data_parallelism():
    _, doc, _ = _build(
        {
            "runtime": "native",
            "model": {"path": "/models/m"},
            "parallelism": {"tensor": 2},
            "gpusPerNode": 8,
        }
    )
    assert json.loads(doc.to_json())["layout"] == {
        "tensor": 2,
        "data": 4,
        "dataLocal": 4,
        "expert": False,
        "worldSize": 8,
    }
    slots = doc.local_ranks(0)
    assert [s.dp_rank for s in slots] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.tp_rank for s in slots] == [0, 1] * 4


def test_agent_pod_has_no_gpu_requests_and_keeps_user_affinity():
    raw = {
        "runtime": "native",
        "model": {"path": "/models/m"},
        "resources": {
            "requests": {"cpu": "1", "nvidia.com/gpu": 8},
            "limits": {"nvidia.com/gpu": 8},
        },
        "placement": {
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "priorityClassName": "system-node-critical",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            },
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["b"]}
                                ]
                            },
                        ]
                    }
                }
            },
        },
    }
    _, doc, ds = _build(
        raw,
        nodes=("n1", "n0"),
        options=resources.AgentOptions(runtime_class="nvidia", service_account="agent"),
    )
    pod = ds["spec"]["template"]["spec"]
    # The user's cpu request wins; the operator's default memory request fills the gap.
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "256Mi"}}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]

    def pin(node: str) -> list[dict]:
        return [{"key": "metadata.name", "operator": "In", "values": [node]}]

    # Every user term crossed with every node: one matchFields value per term.
    assert [t["matchFields"] for t in terms] == [pin("n0"), pin("n0"), pin("n1"), pin("n1")]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"], ["a"], ["b"]]
    assert resources.pinned_nodes(pod) == ["n0", "n1"]
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["runtimeClassName"] == "nvidia" and pod["serviceAccountName"] == "agent"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"]
    init = pod["initContainers"][0]
    # Both host directories of the cache are made the uid's, 0700: sockets and warmup caches.
    assert init["command"][3:] == ["/var/run/weightcache/ml/llama",
                                   "/var/cache/weightcache/ml/llama"]
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann[constants.ANN_EPOCH] == "3"
    assert ann[resources.ANN_PLAN_HASH] == resources.plan_hash(doc)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "100%"


def test_vllm_agent_runs_in_the_engine_image_with_host_namespaces():
    _, doc, ds = _build(
        {
            "runtime": "vllm",
            "image": "vllm/vllm-openai:v0.31.0",
            "model": {
                "path": "/models/m",
                "volume": {"persistentVolumeClaim": {"claimName": "models"}},
            },
        }
    )
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] and pod["hostIPC"]
    assert pod["containers"][0]["image"] == "vllm/vllm-openai:v0.31.0"
    assert [c["name"] for c in pod["initContainers"]] == ["socket-dir", "agent-lib"]
    # The copied agent packages come after the image's own; the vLLM child sees none of them.
    assert pod["containers"][0]["command"] == ["python3", "-c", resources.AGENT_BOOT_VLLM]
    assert "PYTHONPATH" not in {e["name"] for e in pod["containers"][0]["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    assert json.loads(resources.configmap(CACHE, doc)["data"][constants.PLAN_KEY]) == doc.to_doc()


def test_contains_detects_drift_but_not_server_defaults():
    desired = {"spec": {"a": 1, "items": [{"x": 1}]}}
    assert resources.contains({"spec": {"a": 1, "b": 2, "items": [{"x": 1, "y": 0}]}}, desired)
    assert not resources.contains({"spec": {"a": 2, "items": [{"x": 1}]}}, desired)
    assert not resources.contains({"spec": {"a": 1, "items": [{"x": 1}, {"x": 2}]}}, desired)


def test_the_agent_accepts_every_plan_of_the_seed_layouts():
    from weightcache.agent.config import parse_plan

    for par, nodes in [
        ({"tensor": 16, "nodes": 2}, ("a", "b")),
        ({"tensor": 1, "data": 16, "expert": True, "nodes": 4}, ("a", "b", "c", "d")),
        ({"tensor": 8, "data": 2, "nodes": 4}, ("a", "b", "c", "d")),
        ({"tensor": 2}, ("a",)),
    ]:
        raw = {"runtime": "native", "model": {"path": "/models/m"}, "parallelism": par}
        _, doc, _ = _build(raw, nodes=nodes)
        plan = parse_plan(resources.configmap(CACHE, doc)["data"][constants.PLAN_KEY])
        assert plan == doc  # the typed plan survives the ConfigMap unchanged
        assert plan.nodes == {n: i for i, n in enumerate(nodes)}
        assert plan.master_addr == "llama-rendezvous.ml.svc"


def test_owned_objects_are_valid_kubernetes_manifests():
    import kubernetes_validate

    raw = {
        "runtime": "vllm",
        "image": "vllm/vllm-openai:v0.31.0",
        "model": {"path": "/models/m"},
        "parallelism": {"tensor": 16, "nodes": 2},
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
        "placement": {"tolerations": [{"key": "gpu", "operator": "Exists"}]},
    }
    options = resources.AgentOptions(runtime_class="nvidia")
    spec, doc, ds = _build(raw, nodes=("a", "b"), options=options)
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    for obj in (ds, resources.service(CACHE, typed), resources.configmap(CACHE, doc)):
        kubernetes_validate.validate(obj, "1.30", strict=True)
