"""Shapes of the owned objects that integration tests do not reach."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

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
    # Every host directory of the cache is made the uid's, 0700: sockets, warmup caches and
    # the daemons' state.
    assert init["command"][3:] == ["/var/run/weightcache/ml/llama",
                                   "/var/cache/weightcache/ml/llama",
                                   "/var/lib/weightcache/daemon-state/ml/llama"]
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann[constants.ANN_EPOCH] == "3"
    assert ann[resources.ANN_PLAN_HASH] == resources.plan_hash(doc)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "100%"


def _state(ds: dict) -> tuple[dict, dict, dict, dict]:
    """The daemons' state volume, the agent's mount of it, its env and the init container."""
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    volume = {v["name"]: v for v in pod["volumes"]}.get(resources.STATE_VOLUME)
    mount = {m["name"]: m for m in agent["volumeMounts"]}.get(resources.STATE_VOLUME)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    return volume, mount, env, pod["initContainers"][0]


def test_native_daemons_keep_their_import_set_in_a_private_host_dir_of_the_cache(
        tmp_path, monkeypatch):
    from weightcache.native.shared import importset

    raw = {"runtime": "native", "model": {"path": "/models/m"}, "runAs": {"uid": 1234,
                                                                        "gid": 4321}}
    _, _, ds = _build(raw)
    volume, mount, env, init = _state(ds)
    state = "/var/lib/weightcache/daemon-state/ml/llama"  # cache llama in namespace ml
    assert volume == {"name": "daemon-state",
                      "hostPath": {"path": state, "type": "DirectoryOrCreate"}}
    assert mount == {"name": "daemon-state", "mountPath": state}  # read-write
    assert env[constants.ENV_IMPORT_SET] == f"{state}/import-set.json"
    monkeypatch.setenv(importset.ENV, env[constants.ENV_IMPORT_SET])  # what a rank inherits
    assert importset.set_path() == Path(state) / "import-set.json"
    # Neither the socket directory (engines mount it) nor the warmup directory.
    pod = ds["spec"]["template"]["spec"]
    others = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]
              if "hostPath" in v and v["name"] != "daemon-state"}
    assert others == {"sockets": "/var/run/weightcache/ml/llama", "model": "/models",
                      "warmup": "/var/cache/weightcache/ml/llama"}
    # The root init container makes it 1234:4321 0700, like the other private directories.
    assert {"name": "daemon-state", "mountPath": state} in init["volumeMounts"]
    assert init["command"][3:][-1] == state
    assert "chown 1234:4321 \"$d\" && chmod 0700 \"$d\"" in init["command"][2]
    # The script itself, on real directories, chowning to this test's own uid.
    _, _, mine = _build({**raw, "runAs": {"uid": os.getuid(), "gid": os.getgid()}})
    script = _state(mine)[3]["command"][:3]
    dirs = [tmp_path / "sockets", tmp_path / "state"]
    for d in dirs:
        d.mkdir(mode=0o755)
    subprocess.run([*script, *map(str, dirs)], check=True, timeout=30)
    for d in dirs:
        st = d.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def test_two_caches_on_a_node_never_share_a_daemon_state_dir():
    seen = {}
    for namespace, name in (("ml", "llama"), ("ml", "mistral"), ("other", "llama")):
        cache = {"metadata": {"name": name, "namespace": namespace, "uid": f"u-{name}"}}
        spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"}},
                                         namespace, name)
        doc = resources.plan(cache, spec, ["n0"], epoch=1)
        volume, mount, env, _ = _state(resources.daemonset(cache, spec, doc, ["n0"],
                                                           resources.AgentOptions()))
        path = volume["hostPath"]["path"]
        want = f"/var/lib/weightcache/daemon-state/{namespace}/{name}"
        assert mount["mountPath"] == path == want
        assert env[constants.ENV_IMPORT_SET] == f"{path}/import-set.json"
        seen[(namespace, name)] = Path(path)
    paths = list(seen.values())
    assert len(set(paths)) == 3
    # Not only different: none lies inside another.
    assert not any(a != b and a.is_relative_to(b) for a in paths for b in paths)


def test_vllm_agents_get_no_daemon_state_dir():
    _, _, ds = _build({"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0",
                       "model": {"path": "/models/m"}})
    volume, mount, env, init = _state(ds)
    assert volume is None and mount is None and constants.ENV_IMPORT_SET not in env
    assert init["command"][3:] == ["/var/run/weightcache/ml/llama",
                                   "/var/cache/weightcache/ml/llama"]


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
