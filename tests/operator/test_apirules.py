"""Every object the operator builds passes the API server's validation rules (apirules).

kmock stores whatever it is sent, so a test that only reads objects back from it proves nothing
about a real API server. `weightcache.testing.apirules` restates the server's rules this project
relies on, with their sources; here it judges the objects built for every chart example and for
the extreme specs the CRD schema allows (longest name and namespace, most nodes, longest node
names, most GPUs, every runtime), and each rule is shown to catch what it names.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightcache import constants
from weightcache.api.v1alpha1 import MAX_GPUS_PER_NODE, MAX_NODES, WeightCacheSpec, with_defaults
from weightcache.contracts.plan import SeedSource
from weightcache.operator import crd, events, podsecurity, resources
from weightcache.operator import status as cache_status
from weightcache.operator.kube import ApiError, Kube
from weightcache.operator.spec import MAX_NAME_LENGTH, Problem, name_problems, validate
from weightcache.testing import apirules

EXAMPLES = Path(__file__).resolve().parents[2] / "charts" / "weightcache" / "examples"
WC_SCHEMA = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
LONG_NS = "n" * 63
LONG_NAME = "c" * MAX_NAME_LENGTH


def example_caches() -> list[tuple[str, str, str, dict]]:
    """(id, namespace, name, spec) of every WeightCache in charts/weightcache/examples."""
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc.get("kind") == constants.KIND:
                meta = doc["metadata"]
                found.append(
                    (path.stem, meta.get("namespace", "default"), meta["name"], doc["spec"])
                )
            for entry in doc.get("caches") or []:
                ns = entry.get("namespace", "default")
                found.append((f"{path.stem}:{entry['name']}", ns, entry["name"], entry["spec"]))
    assert len(found) >= 5, found
    return found


def node_name(i: int) -> str:
    """A 253-character node name (the longest DNS-1123 subdomain), unique per i."""
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, f"node-{i:056d}"])
    assert len(name) == 253
    return name


def _affinity_terms() -> dict:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {
                        "matchExpressions": [
                            {"key": "nvidia.com/gpu.product", "operator": "Exists"}
                        ],
                        "matchFields": [
                            {"key": "metadata.name", "operator": "NotIn", "values": ["bad"]}
                        ],
                    },
                ]
            }
        }
    }


EXTREMES: dict[str, dict[str, Any]] = {
    "native-most-nodes": {
        "runtime": "native",
        "model": {"path": "/models/m"},
        "parallelism": {"tensor": 8, "data": MAX_NODES, "nodes": MAX_NODES},
        "gpusPerNode": 8,
    },
    "vllm-most-nodes-user-affinity": {
        "runtime": "vllm",
        "image": "registry.example.com:5000/team/vllm-openai:v0.31.0",
        "model": {"path": "/models/ds", "volume": {"nfs": {"server": "nfs", "path": "/m"}}},
        "parallelism": {"tensor": 8, "data": MAX_NODES, "nodes": MAX_NODES, "expert": True},
        "gpusPerNode": 8,
        "placement": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"operator": "Exists"},
                {
                    "key": "k",
                    "operator": "Equal",
                    "value": "v",
                    "effect": "NoExecute",
                    "tolerationSeconds": 30,
                },
            ],
            "affinity": _affinity_terms(),
            "priorityClassName": "gpu-critical",
        },
    },
    "native-most-gpus": {
        "runtime": "native",
        "model": {"path": "/models/m"},
        "parallelism": {"tensor": MAX_GPUS_PER_NODE},
        "gpusPerNode": MAX_GPUS_PER_NODE,
    },
    "native-cpu": {"runtime": "native", "device": "cpu", "model": {"path": "/models/tiny"}},
    "vllm-tp16-two-nodes": {
        "runtime": "vllm",
        "image": "vllm/vllm-openai:v0.31.0",
        "model": {"path": "/models/big"},
        "parallelism": {"tensor": 16, "nodes": 2},
        "gpusPerNode": 8,
        "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": 8}},
    },
    # A seed target of the most nodes: a peer address per node rank in the plan, the source's
    # token mounted (docs/warmup.md, "Seeding new replicas").
    "vllm-seed-target-most-nodes": {
        "runtime": "vllm",
        "image": "vllm/vllm-openai:v0.33.0",
        "model": {"path": "/models/big"},
        "parallelism": {"tensor": MAX_NODES, "nodes": MAX_NODES},
        "warmup": {"seed": {"from": "s" * MAX_NAME_LENGTH}},
    },
}


def built_objects(namespace: str, name: str, raw: dict, nodes: list[str]) -> list[dict]:
    """Everything the reconciler writes for one cache: owned objects, status, events, labels."""
    cache = {"metadata": {"name": name, "namespace": namespace, "uid": "6b1f3c52-0c1e-4f0e"}}
    spec = with_defaults(copy.deepcopy(raw), namespace, name)
    assert name_problems(name) + validate(spec) == [], "not a spec the schema and webhook admit"
    typed = WeightCacheSpec.from_spec(spec, "ns", "c")
    lay = typed.layout()
    nodes = nodes[: lay.nodes]
    seed_from = None
    if typed.warmup.seed.from_:
        # The longest address (IPv6) for every node rank.
        seed_from = SeedSource(cache=typed.warmup.seed.from_, port=65535,
                               hosts={r: "fd00:" + "ffff:" * 6 + "ffff" for r in range(lay.nodes)})
    doc = resources.plan(cache, typed, nodes, epoch=7, seed_from=seed_from)
    options = resources.AgentOptions(
        runtime_class="nvidia", service_account="agent", priority_class="pc"
    )
    objs = [
        resources.configmap(cache, doc),
        resources.service(cache, WeightCacheSpec.from_spec(spec, "ns", "c")),
        resources.daemonset(cache, doc.spec, doc, nodes, options),
        resources.seed_secret(cache),
    ]
    states = [
        cache_status.NodeState(node=n, rank=i, ranks_total=typed.launched_layout().ranks_per_node)
        for i, n in enumerate(nodes)
    ]
    server_message = "x" * 40000  # an API server message longer than a condition takes
    statuses = [
        cache_status.observed({}, nodes=states, pods_seen=0, epoch=7, generation=3),
        cache_status.failed({}, reason="ApplyRejected", message=server_message, generation=3),
        cache_status.failed({}, reason="PodSecurity", message=podsecurity.blocked_message(
            namespace, "baseline", spec["runtime"]), generation=3, nodes=states, epoch=7),
        cache_status.unschedulable({}, need=lay.nodes, eligible=0, reasons={"NotReady": 3},
                                   generation=3),
        cache_status.invalid({}, [Problem("spec.x", "y" * 100)], generation=3),
    ]  # fmt: skip
    cache_status.with_condition(statuses[0], {}, cache_status.SEEDING, cache_status.Cond(
        False, "SourceMismatch", server_message), 3)
    for status in statuses:
        status["podSecurity"] = "baseline"
        objs.append({"apiVersion": constants.API_VERSION, "kind": constants.KIND,
                     "metadata": cache["metadata"], "spec": raw, "status": status})  # fmt: skip
    for reason in ("Placed", "ApplyRejected", "PodSecurity", "SeedSourceMismatch"):
        objs.append(
            events.event_body(
                events.cache_ref(cache["metadata"]),
                type_="Warning",
                reason=reason,
                message=server_message,
                component="weightcache-operator",
            )
        )
    for rank, node in enumerate(nodes[:2]):
        labels = {constants.node_ready_label(namespace, name): "ready"}
        objs.append(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
        )
        pod_labels = {**resources.labels(name), constants.LABEL_NODE_RANK: str(rank)}
        template = objs[2]["spec"]["template"]
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-agent-x7k2p",
                    "namespace": namespace,
                    "labels": pod_labels,
                },
                "spec": {**template["spec"], "nodeName": node},
            }
        )
    return objs


CASES = [(i, ns, n, spec) for i, ns, n, spec in example_caches()] + [
    (key, LONG_NS, LONG_NAME, spec) for key, spec in EXTREMES.items()
]


@pytest.mark.parametrize(
    ("namespace", "name", "raw"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_built_object_passes_the_api_server_rules(namespace, name, raw):
    """The general guard: what a real API server would answer 422 to never leaves the builders."""
    nodes = [node_name(i) for i in range(MAX_NODES)]
    for obj in built_objects(namespace, name, raw, nodes):
        problems = apirules.check(obj, crd_schema=WC_SCHEMA)
        assert not problems, f"{obj['kind']} {obj['metadata'].get('name')}: " + "; ".join(
            map(str, problems)
        )


def test_rules_name_their_source():
    assert all(r.source and "/" in r.source for r in apirules.RULES.values())
    ids = {rule.id for rule in apirules.RULES.values()}
    assert {
        "pod.affinity.match-fields",
        "name.service",
        "condition",
        "daemonset.tolerations",
    } <= ids


# -- each rule catches the defect it names ---------------------------------------------


def _rules(obj: dict) -> set[str]:
    return {v.rule for v in apirules.check(obj, crd_schema=WC_SCHEMA)}


def _ds(nodes: list[str]) -> dict:
    cache = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u"}}
    spec = with_defaults(
        {"runtime": "native", "model": {"path": "/m"}, "parallelism": {"tensor": 16, "nodes": 2},
         "gpusPerNode": 8}, "ml", "llama")  # fmt: skip
    doc = resources.plan(cache, WeightCacheSpec.from_spec(spec, "ns", "c"), nodes, epoch=1)
    return resources.daemonset(cache, doc.spec, doc, nodes, resources.AgentOptions())


def test_item1_several_nodes_in_one_match_fields_requirement_are_rejected():
    """Item 1: validateNodeFieldSelectorRequirement takes exactly one value with In/NotIn."""
    ds = _ds(["n1", "n2"])
    assert _rules(ds) == set()
    required = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    # The shape the operator used to write, which a real API server answered with 422:
    required["nodeSelectorTerms"] = [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}]}
    ]
    problems = apirules.check(ds)
    assert [p.rule for p in problems] == ["pod.affinity.match-fields"]
    assert "must be only one value when `operator` is 'In' or 'NotIn'" in problems[0].message
    required["nodeSelectorTerms"] = [
        {"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["n1"]}]}
    ]
    assert _rules(ds) == {"pod.affinity.match-fields"}


@pytest.mark.parametrize(
    ("name", "ok"),
    [("a" * 52 + "-rendezvous", True), ("a" * 53 + "-rendezvous", False),
     ("1llama-rendezvous", False), ("my.cache-rendezvous", False)],
)  # fmt: skip
def test_item3_service_names_are_dns1035_labels(name, ok):
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "ml"}}
    assert ("name.service" not in _rules(svc)) is ok
    # The same names are fine for a ConfigMap (a DNS-1123 subdomain), except the too-long one.
    cm = {**svc, "kind": "ConfigMap"}
    assert ("name.subdomain" in _rules(cm)) is (len(name) > 253)


def test_item3_names_the_schema_admits_give_valid_derived_names():
    assert MAX_NAME_LENGTH + len("-rendezvous") == 63
    assert name_problems("c" * MAX_NAME_LENGTH) == []
    assert [p.field for p in name_problems("c" * (MAX_NAME_LENGTH + 1))] == ["metadata.name"]
    assert "DNS-1035" in str(name_problems("7b-llama")[0])


@pytest.mark.parametrize(
    ("condition", "ok"),
    [
        ({"reason": "ApplyRejected"}, True),
        ({"reason": "Apply Rejected"}, False),
        ({"reason": "apply-rejected"}, False),
        ({"reason": ""}, False),
        ({"reason": "A", "message": "m" * 32769}, False),
        ({"reason": "A", "lastTransitionTime": None}, False),
        ({"reason": "A", "status": "Maybe"}, False),
    ],
)
def test_item4_conditions_follow_metav1_condition(condition, ok):
    base = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-12-01T00:00:00Z"}
    cache = {"apiVersion": constants.API_VERSION, "kind": constants.KIND,
             "metadata": {"name": "llama", "namespace": "ml"},
             "status": {"conditions": [{**base, **condition}]}}  # fmt: skip
    assert ("condition" not in _rules(cache)) is ok


def test_item4_status_fields_the_schema_lacks_are_reported_as_pruned():
    cache = {"apiVersion": constants.API_VERSION, "kind": constants.KIND,
             "metadata": {"name": "llama", "namespace": "ml"},
             "status": {"nodes": [{"node": "n", "restarts": 1, "unknown": 2}]}}  # fmt: skip
    pruned = [v.field for v in apirules.check(cache, crd_schema=WC_SCHEMA)]
    assert pruned == ["status.nodes[0].unknown"]  # restarts is declared now


def test_events_live_in_their_objects_namespace():
    event = events.event_body({"name": "llama", "namespace": "ml", "kind": constants.KIND},
                              type_="Normal", reason="R", message="m", component="c")  # fmt: skip
    assert _rules(event) == set()
    event["metadata"]["namespace"] = "other"
    assert _rules(event) == {"event.namespace"}


@pytest.mark.parametrize(
    ("toleration", "ok"),
    [
        ({"key": "gpu", "operator": "Exists"}, True),
        ({"operator": "Exists"}, True),
        ({"key": "gpu", "operator": "Exists", "value": "x"}, False),
        ({"operator": "Equal", "value": "x"}, False),
        ({"key": "gpu", "value": "x", "effect": "NoSchedule", "tolerationSeconds": 5}, False),
        ({"key": "gpu", "effect": "Sometimes"}, False),
    ],
)
def test_tolerations_follow_validate_tolerations(toleration, ok):
    ds = _ds(["n1", "n2"])
    ds["spec"]["template"]["spec"]["tolerations"] = [toleration]
    assert ("pod.tolerations" not in _rules(ds)) is ok


def test_probes_volumes_ports_env_and_selector_rules_catch_breakage():
    ds = _ds(["n1", "n2"])
    pod = ds["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    agent["livenessProbe"]["httpGet"] = {"port": 80}
    agent["readinessProbe"]["grpc"]["port"] = 0
    agent["ports"][0]["name"] = "grpc-port-too-long"
    agent["env"].append({"name": "1BAD=", "value": "x"})
    agent["volumeMounts"].append({"name": "missing", "mountPath": "/x"})
    pod["volumes"].append({"name": "Bad_Name", "emptyDir": {}, "hostPath": {"path": "/x"}})
    ds["spec"]["selector"]["matchLabels"]["extra"] = "x"
    assert _rules(ds) == {
        "pod.probes", "pod.ports", "pod.env", "pod.mounts", "pod.volumes", "daemonset.selector"
    }  # fmt: skip


def test_secret_and_secret_volume_rules_catch_breakage():
    cache = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u"}}
    secret = resources.seed_secret(cache)
    assert _rules(secret) == set()
    secret["data"] = {"bad/key": "bm90", "token": "not base64!"}
    assert _rules(secret) == {"secret.data"}
    spec = WeightCacheSpec.from_spec({"runtime": "vllm", "image": "v:1", "model": {"path": "/m"},
                                      "parallelism": {"tensor": 2}}, "ml", "llama")
    ds = resources.daemonset(cache, spec, resources.plan(cache, spec, ["n1"], 1), ["n1"],
                             resources.AgentOptions())
    assert _rules(ds) == set()
    (vol,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    vol["secret"]["defaultMode"] = 0o1777
    vol["secret"]["items"][0]["path"] = "../token"
    assert _rules(ds) == {"pod.secret-volume"}


def test_item6_agent_pods_need_the_privileged_level_for_both_runtimes():
    """Item 6: Pod Security baseline refuses agents (hostPath; vllm also host namespaces)."""
    native = _ds(["n1", "n2"])["spec"]["template"]["spec"]
    assert apirules.pod_security_violations(native, "privileged") == []
    # The socket and warmup directories always, the daemons' state for runtime native; the
    # model too when it is read from the node (the default).
    assert apirules.pod_security_violations(native, "baseline") == [
        "hostPath volume 'sockets'",
        "hostPath volume 'model'",
        "hostPath volume 'warmup'",
        "hostPath volume 'daemon-state'",
    ]
    assert podsecurity.agent_needs("native") == [
        "hostPath volumes (the socket and warmup directories shared with engines, the daemons' "
        "state directory)"]  # fmt: skip
    cache = {"metadata": {"name": "v", "namespace": "ml", "uid": "u"}}
    spec = with_defaults({"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0",
                          "model": {"path": "/m"}}, "ml", "v")  # fmt: skip
    doc = resources.plan(cache, WeightCacheSpec.from_spec(spec, "ns", "c"), ["n1"], epoch=1)
    ds = resources.daemonset(cache, doc.spec, doc, ["n1"], resources.AgentOptions())
    vllm = ds["spec"]["template"]["spec"]
    found = apirules.pod_security_violations(vllm, "baseline")
    assert "hostPID=true" in found and "hostIPC=true" in found
    assert any("hostPath" in f for f in found)
    assert "hostPath volume 'daemon-state'" not in found  # vLLM's daemon keeps no state
    assert podsecurity.agent_needs("vllm") == [
        "hostPath volumes (the socket and warmup directories shared with engines)",
        "hostPID and hostIPC (stock vLLM CUDA IPC)"]  # fmt: skip


async def test_the_kmock_guard_answers_422_like_the_api_server(cluster, api_guard):
    """The guard hooked into kmock refuses an invalid write from the operator's own client."""
    ds = _ds(["n1", "n2"])
    required = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    required["nodeSelectorTerms"] = [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}]}
    ]
    kube = Kube.connect()
    try:
        with pytest.raises(ApiError) as err:
            await kube.create("/apis/apps/v1/namespaces/ml/daemonsets", ds)
        assert err.value.status == 422
        assert "must be only one value" in err.value.message
        assert await kube.get("/apis/apps/v1/namespaces/ml/daemonsets/llama-agent") is None
        ds = _ds(["n1", "n2"])
        await kube.create("/apis/apps/v1/namespaces/ml/daemonsets", ds)  # the fixed shape passes
    finally:
        await kube.close()
    assert len(api_guard.violations) == 1
    api_guard.violations.clear()  # the rejection was the point of this test


def test_crd_defaults_validate_against_their_own_schema():
    """Rule crd.defaults: the server refuses a CRD whose default fails its schema."""
    assert apirules.default_violations(WC_SCHEMA) == []
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "default": 0}}}
    assert [v.field for v in apirules.default_violations(bad)] == ["n"]


@pytest.mark.parametrize(
    "raw",
    [
        *[spec for _id, _ns, _name, spec in example_caches()],
        {"runtime": "native", "model": {"path": "/models/m"}, "ports": {"grpc": 9000}},
        {"runtime": "native", "model": {"path": "/models/m"}, "engineArgs": {},
         "parallelism": {"data": 2}, "engine": {}, "runAs": {}},
    ],
)
def test_server_defaults_agree_with_the_typed_api(raw):
    """What the API server stores (its defaults applied where the parent is present) parses to
    the same spec document as what the user wrote: the schema's defaults are the API's."""
    stored = apirules.apply_defaults(raw, WC_SCHEMA["properties"]["spec"])
    typed = WeightCacheSpec.from_spec(stored, "ns", "c").to_dict()
    assert typed == WeightCacheSpec.from_spec(raw, "ns", "c").to_dict()
