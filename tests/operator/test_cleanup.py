"""The cleanup Job's two steps really remove a cache's host directories (the warmup directory,
the native daemons' state directory), and nothing outside them.

The scripts are run with the node's shell on a real tree (files, nested directories, a
symlink to a directory outside the cache, which `find -P` must not follow); the Job's own
directory arguments are replaced by the test's (the state directory is /var/lib/...)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator import cleanup, resources
from weightcache.testing import apirules

CACHE = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}}


def run(job: dict, *targets: Path) -> None:
    pod = job["spec"]["template"]["spec"]
    for c in (*pod["initContainers"], *pod["containers"]):
        argv = [*c["command"][:3], *map(str, targets)]
        subprocess.run(argv, check=True, timeout=30)


def dirs(job: dict) -> tuple[list[str], list[str], list[dict]]:
    """What each step removes, and the Job's volumes."""
    pod = job["spec"]["template"]["spec"]
    return (pod["initContainers"][0]["command"][3:], pod["containers"][0]["command"][3:],
            pod["volumes"])


def test_the_job_empties_and_removes_the_directory_without_following_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    warm = tmp_path / "ml" / "llama"
    (warm / "0123456789abcdef" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (warm / "0123456789abcdef" / "vllm" / "torch_compile_cache" / "k.so").write_bytes(b"x")
    (warm / "0123456789abcdef" / "link").symlink_to(outside)
    spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"},
                                      "warmup": {"cacheDir": str(warm)}}, "ml", "llama")
    job = cleanup.job(CACHE, spec, "gpu-a", resources.AgentOptions())
    assert apirules.check(job) == []
    assert job["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == str(warm.parent)
    state = tmp_path / "state" / "ml" / "llama"  # for /var/lib/weightcache/daemon-state/...
    state.mkdir(parents=True)
    (state / "import-set.json").write_text("{}")
    run(job, warm, state)
    assert not warm.exists() and warm.parent.exists()
    assert not state.exists() and state.parent.exists()
    assert (outside / "precious").read_text() == "keep"
    run(job, warm, state)  # a retry (or a node that never held it) succeeds and changes nothing


def test_a_native_cache_cleans_its_warmup_and_daemon_state_directories():
    spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"}},
                                     "ml", "llama")
    job = cleanup.job(CACHE, spec, "gpu-a", resources.AgentOptions())
    assert apirules.check(job) == []
    both = ["/var/cache/weightcache/ml/llama", "/var/lib/weightcache/daemon-state/ml/llama"]
    empty, remove, volumes = dirs(job)
    assert empty == remove == both == cleanup.targets(CACHE, spec)
    assert [v["name"] for v in volumes] == ["parent-0", "parent-1"]
    assert [v["hostPath"] for v in volumes] == [
        {"path": "/var/cache/weightcache/ml", "type": "Directory"},
        {"path": "/var/lib/weightcache/daemon-state/ml", "type": "Directory"},
    ]
    mounts = job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert mounts == [{"name": "parent-0", "mountPath": "/var/cache/weightcache/ml"},
                      {"name": "parent-1",
                       "mountPath": "/var/lib/weightcache/daemon-state/ml"}]
    # Warmup off: the state directory alone; runtime vllm keeps none (warmup alone, or nothing).
    off = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"},
                                     "warmup": {"enabled": False}}, "ml", "llama")
    assert dirs(cleanup.job(CACHE, off, "gpu-a", resources.AgentOptions()))[0] == both[1:]
    vllm = {"runtime": "vllm", "image": "vllm/vllm-openai:v0.31.0", "model": {"path": "/m"}}
    assert cleanup.targets(CACHE, WeightCacheSpec.from_spec(vllm, "ml", "llama")) == both[:1]
    assert cleanup.targets(CACHE, WeightCacheSpec.from_spec(
        {**vllm, "warmup": {"enabled": False}}, "ml", "llama")) == []


def test_a_symlinked_directory_is_refused_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    warm = tmp_path / "llama"
    warm.symlink_to(outside)
    spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"},
                                      "warmup": {"cacheDir": str(warm)}}, "ml", "llama")
    job = cleanup.job(CACHE, spec, "gpu-a", resources.AgentOptions())
    empty = job["spec"]["template"]["spec"]["initContainers"][0]["command"]
    state = tmp_path / "state"
    state.mkdir()
    (state / "import-set.json").write_text("{}")
    assert subprocess.run([*empty[:3], str(warm), str(state)], timeout=30).returncode != 0
    assert (outside / "precious").read_text() == "keep"
    # The other directory is emptied all the same.
    assert state.exists() and list(state.iterdir()) == []


def test_job_names_are_labels_and_differ_per_node_and_cache_object():
    names = {resources_name(n, u) for n in ("a", "b" * 253) for u in ("u1", "u2")}
    assert len(names) == 4 and all(apirules.is_dns1123_label(n) for n in names)


def resources_name(node: str, uid: str) -> str:
    from weightcache import constants

    return constants.cleanup_job_name("x" * 63, node, uid)


def test_the_job_breaks_no_api_rule_when_broken_on_purpose():
    spec = WeightCacheSpec.from_spec({"runtime": "native", "model": {"path": "/models/m"}},
                                     "ml", "llama")
    job = cleanup.job(CACHE, spec, "gpu-a", resources.AgentOptions())
    job["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    job["spec"]["ttlSecondsAfterFinished"] = -1
    assert {v.rule for v in apirules.check(job)} == {"job.spec"}
