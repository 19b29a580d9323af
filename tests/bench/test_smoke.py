"""Every section of `weightcache bench` runs on CPU at its smallest size.

Benchmarks that nothing runs rot: the operator section once timed out on every run because its
stand-in DaemonSet controller read only the first node selector term, and nobody noticed
until someone measured. Figures are not checked here (they live in committed benchmark
output); what is checked is that each section finishes, exits 0 and prints its table.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightcache.bench.report import SECTIONS

# Sections that measure a GPU and say so on CPU; every other section must really run here.
CUDA_ONLY = {"gpu"}
# Sections whose smoke size still compiles a model in fresh processes (restart: a cold Inductor
# compile of a 1-layer Llama takes tens of seconds on two shared cores).
TIMEOUT_S = {"restart": 600}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_section_runs_at_smoke_size(section: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke", section],
        capture_output=True, text=True, timeout=TIMEOUT_S.get(section, 240), env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"({section}: " in proc.stdout and "exit 0)" in proc.stdout, out[-4000:]
    skipped = "skipped" in proc.stdout
    if section in CUDA_ONLY:
        assert skipped, out[-2000:]
    else:
        assert not skipped, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
