"""vLLM's own rank-to-GPU mapping (tests/alignment/test_vllm_rule.py) against each supported
vLLM version's real code.

That test imports vLLM in its own process, which the main test process cannot do (vLLM lives
in its own folder per version, beside the CPU torch); so it runs here in a child pytest with
that version's folder on PYTHONPATH, and must pass in full.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conformance.conftest import INSTALL, VERSIONS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_maps_rank_i_to_the_aligned_gpu(version: str) -> None:
    target = INSTALL / version
    if not (target / "vllm" / "__init__.py").exists():
        why = f"vLLM {version} is not installed in {target} (make vllm-conformance)"
        if os.environ.get("WEIGHTCACHE_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(target),
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests/alignment/test_vllm_rule.py")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-1000:]
    assert "passed" in out.stdout.splitlines()[-1]
