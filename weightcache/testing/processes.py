"""The project's commands as child processes: a `weightcache preload` to start and stop,
one `weightcache attach` in a fresh interpreter, the way a restarting engine would run, and the
command line of a standalone `weightcache operator`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def weightcache_cmd() -> list[str]:
    return [sys.executable, "-m", "weightcache.cli"]


def operator_cmd(namespace: str, *flags: str) -> list[str]:
    """`weightcache operator` for one namespace, alone (no peering, no cluster-wide scan)."""
    return [*weightcache_cmd(), "operator", "--namespace", namespace, "--standalone",
            "--no-scanning", *flags]


class Preload:
    """A `weightcache preload` child: start, wait for READY, stop (SIGTERM, then SIGKILL).

    It runs with --exit-with-parent, so it never outlives us even if we are killed outright.
    """

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*weightcache_cmd(), "preload", "--exit-with-parent", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.ready: dict[str, Any] | None = None
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(
                    f"weightcache preload exited ({self.proc.wait()}) before READY:\n{err}"
                )
            self.lines.append(line)
            if line.startswith("READY "):
                self.ready = json.loads(line[len("READY ") :])
                return self.ready
        raise TimeoutError("weightcache preload did not become ready")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return self.proc.returncode


def run_attach(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `weightcache attach` in a fresh process, like a restarting engine."""
    out = subprocess.run(
        [*weightcache_cmd(), "attach", *args], capture_output=True, text=True, env=env, check=False
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"weightcache attach failed ({out.returncode}):\n{out.stderr}")
    return json.loads(lines[-1])


# Prepended to a child's code: every `cuda` module (cuda-python) fails to import, as on a
# machine without it, whatever this one has installed.
_NO_CUDA_PYTHON = '''import sys
class _NoCudaPython:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, _NoCudaPython())
'''


def run_without_cuda_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that cannot import cuda-python (stdout and stderr as
    text)."""
    return subprocess.run([sys.executable, "-c", _NO_CUDA_PYTHON + code], capture_output=True,
                          text=True, timeout=timeout, check=False)
