"""Generated engine scripts, run by a real shell with a stub `vllm`: what vLLM receives.

The judge is execution, not text: each generated script runs under `sh -c` (as the
container would) before and after injection, with a stub `vllm` on PATH that appends its
argv as JSON to a file. After injection the stub must receive exactly its old argv plus
the loader flags, the script's own output must not change (so `echo "... vllm serve ..."`,
comments and `&&` chains are left alone), and injecting the injected script again must
change nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.admission.conftest import cache_obj
from weightcache.operator.admission import inject

SHELL = "/bin/sh"
STUB = """#!/bin/sh
exec {python} -c 'import json, os, sys
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")' vllm "$@"
"""

DECOYS = [
    "# start vllm serve now",
    'echo "starting vllm serve now"',
    "echo 'vllm serve --load-format auto'",
    ": vllm serve",
    "printf '%s\\n' \"vllm serve /x\"",
    "export MODE=serve",
    "true # vllm serve",
    "cat <<'EOF'\nvllm serve from a heredoc\nEOF",
]
WORDS = ["--port", "8000", "--max-model-len=8192", "-tp", "2", "--dtype", "bfloat16",
         "--served-model-name", "my model", "--api-key", "$KEY", "--trust-remote-code"]


def quote(word: str, style: int) -> str:
    if "$" in word:
        return f'"{word}"'
    if style == 1 or " " in word:
        return shlex.quote(word) if " " in word else f"'{word}'"
    if style == 2:
        return f'"{word}"'
    return word


@st.composite
def scripts(draw: st.DrawFn) -> str:
    before = draw(st.lists(st.sampled_from(DECOYS), max_size=3))
    args = draw(st.lists(st.sampled_from(WORDS), max_size=6))
    styles = draw(st.lists(st.integers(0, 2), min_size=len(args), max_size=len(args)))
    seps = draw(st.lists(st.sampled_from([" ", " \\\n  ", "  "]), min_size=len(args) + 1,
                         max_size=len(args) + 1))
    model = quote("/models/llama", draw(st.integers(0, 2)))
    cmd = "vllm" + seps[0] + "serve " + model
    for word, style, sep in zip(args, styles, seps[1:], strict=True):
        cmd += sep + quote(word, style)
    if draw(st.booleans()):
        cmd = "exec " + cmd
    elif draw(st.booleans()):
        cmd = cmd + " > \"$LOG\" 2>&1"
    joiner = draw(st.sampled_from(["\n", "; ", " && "]))
    parts = [*before, cmd] if before else [cmd]
    script = ""
    for i, part in enumerate(parts):
        # a heredoc or a comment must end its line before the next command
        glue = "\n" if i and ("<<" in parts[i - 1] or "#" in parts[i - 1]) else joiner
        script += (glue if i else "") + part
    if not cmd.startswith("exec") and draw(st.booleans()):
        script += ("\n" if "#" in cmd else "; ") + "echo done"
    return script


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bin_dir = tmp_path_factory.mktemp("bin")
    stub = bin_dir / "vllm"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    return bin_dir


def run(script: str, bin_dir: Path, tmp: Path) -> tuple[list[list[str]], str]:
    out = tmp / "argv.jsonl"
    out.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(out), "KEY": "k 1",
           "LOG": str(tmp / "log"), "HOME": str(tmp)}
    proc = subprocess.run([SHELL, "-c", script], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return calls, proc.stdout


CACHE = cache_obj(name="gen")


def shell_pod(script: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "serving",
                     "annotations": {"weightcache.io/cache": "gen"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.31.0",
                                 "command": ["/bin/sh", "-c", script]}]},
    }


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=scripts())
def test_vllm_receives_its_argv_plus_the_loader_flags(
    script: str, stub_path: Path, tmp_path: Path
) -> None:
    before_calls, before_out = run(script, stub_path, tmp_path)
    assert len(before_calls) == 1  # the generator wrote one real vllm command
    res = inject.inject(shell_pod(script), CACHE)
    injected = res.pod["spec"]["containers"][0]["command"][2]
    after_calls, after_out = run(injected, stub_path, tmp_path)
    assert after_out == before_out  # decoys untouched
    (old,), (new,) = before_calls, after_calls
    assert new[: len(old)] == old
    added = new[len(old):]
    assert added[:2] == ["--load-format", "ipc_cache"]
    assert added[2] == "--model-loader-extra-config"
    assert json.loads(added[3])["socket_dir"] == "/var/run/weightcache/serving/gen"
    assert len(added) == 4
    again = inject.inject(res.pod, CACHE)
    assert again.ops == []  # idempotent on re-admission


def test_continuation_with_load_format_on_the_next_line_is_not_denied(
    stub_path: Path, tmp_path: Path
) -> None:
    script = "exec vllm serve /m \\\n  --load-format \\\n  ipc_cache --port 8000"
    res = inject.inject(shell_pod(script), CACHE)
    injected = res.pod["spec"]["containers"][0]["command"][2]
    (argv,), _ = run(injected, stub_path, tmp_path)
    assert argv[:7] == ["vllm", "serve", "/m", "--load-format", "ipc_cache", "--port", "8000"]
    assert argv[7] == "--model-loader-extra-config" and len(argv) == 9


def test_nested_shell_string_running_vllm_is_denied() -> None:
    script = "bash -c 'exec vllm serve /m'"
    with pytest.raises(inject.Denied, match="nested shell string"):
        inject.inject(shell_pod(script), CACHE)


@pytest.mark.skipif(not os.path.exists(SHELL), reason="needs /bin/sh")
def test_every_vllm_command_of_a_script_gets_the_flags(stub_path: Path, tmp_path: Path) -> None:
    script = 'if [ -n "$KEY" ]; then vllm serve /a; else vllm serve /b; fi; vllm serve /c'
    res = inject.inject(shell_pod(script), CACHE)
    calls, _ = run(res.pod["spec"]["containers"][0]["command"][2], stub_path, tmp_path)
    assert [c[2] for c in calls] == ["/a", "/c"]
    assert all(c[3:5] == ["--load-format", "ipc_cache"] and len(c) == 7 for c in calls)
