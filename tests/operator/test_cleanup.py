"""The cleanup Job's two steps really remove a warmup directory, and nothing outside it.

The scripts are run with the node's shell on a real tree (files, nested directories, a
symlink to a directory outside the cache, which `find -P` must not follow)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.operator import cleanup, resources
from weightcache.testing import apirules

CACHE = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}}


def run(job: dict, target: Path) -> None:
    pod = job["spec"]["template"]["spec"]
    for c in (*pod["initContainers"], *pod["containers"]):
        argv = [*c["command"][:-1], str(target)]
        subprocess.run(argv, check=True, timeout=30)


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
    run(job, warm)
    assert not warm.exists() and warm.parent.exists()
    assert (outside / "precious").read_text() == "keep"
    run(job, warm)  # a retry (or a node that never held it) succeeds and changes nothing


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
    assert subprocess.run([*empty[:-1], str(warm)], timeout=30).returncode != 0
    assert (outside / "precious").read_text() == "keep"


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
