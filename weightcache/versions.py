"""What this release supports and was tested with: the one table docs/install.md shows.

tests/chart/test_install.py checks that docs/install.md, the Dockerfiles, the chart's
kubeVersion and the examples agree with these values, so a version bump is made here first.
The vLLM versions are the ones whose `vllm preload` / `ipc_cache` flags the agent's vllm
runtime is written against (agent/runtimes/vllm.py).
"""

from __future__ import annotations

KUBERNETES_MIN = "1.30"  # charts/weightcache/Chart.yaml kubeVersion
KUBERNETES_TESTED = ("1.35", "1.36")  # kubectl/helm in CI (1.35) and the kind suite's API server
VLLM_SUPPORTED = ("0.33.0",)  # runtime vllm: engines and the agent run the same image tag
VLLM_IMAGE_EXAMPLE = f"vllm/vllm-openai:v{VLLM_SUPPORTED[-1]}"
PYTHON_IMAGE = "3.12"  # Dockerfile PYTHON_IMAGE: the vLLM image's Python minor version
NVIDIA_DRIVER_TESTED = "580"  # H200, torch 2.11+cu130, VMM fd export over SCM_RIGHTS
