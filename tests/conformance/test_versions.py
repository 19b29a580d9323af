"""The vLLM versions the conformance suite installs and checks (versions.txt, read by the
Makefile before any venv exists) are exactly the versions the project says it supports
(weightcache/versions.py, which the docs, images and examples are checked against)."""

from tests.conformance.conftest import VERSIONS
from weightcache.versions import VLLM_SUPPORTED


def test_conformance_covers_exactly_the_supported_versions() -> None:
    assert sorted(VERSIONS) == sorted(VLLM_SUPPORTED)
