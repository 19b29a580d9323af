"""The import contract of `.importlinter`, run by import-linter itself over the installed layout.

`make test` runs it too; this test keeps CI checking it whatever the Makefile says, and proves
the check sees the mapped folders (`operator/` as weightcache.operator, `agent/` as
weightcache.agent): a planted violation there must break a contract.
"""

from __future__ import annotations

from pathlib import Path

from weightcache.testing import layering

REPO = Path(__file__).resolve().parents[2]


def test_the_tree_keeps_every_contract():
    result = layering.run(capture=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def test_a_violation_in_a_mapped_folder_is_caught(tmp_path):
    root = layering.mirror(tmp_path)
    operator = root / "weightcache" / "operator"
    operator.unlink()
    operator.mkdir()
    for entry in (REPO / "operator").iterdir():
        (operator / entry.name).symlink_to(entry)
    (operator / "_planted.py").write_text("from weightcache.agent import config\n")
    result = layering.run_in(root, capture=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "weightcache.operator._planted -> weightcache.agent.config" in result.stdout
    assert "1 broken" in result.stdout


def _unfold(link: Path, source: Path) -> None:
    """Replace the mirror's link to a folder by a folder of links to its entries."""
    link.unlink()
    link.mkdir()
    for entry in source.iterdir():
        if entry.name != "__pycache__":
            (link / entry.name).symlink_to(entry)


def test_the_daemon_side_importing_the_engine_side_is_caught(tmp_path):
    root = layering.mirror(tmp_path)
    native = root / "weightcache" / "native"
    _unfold(native, REPO / "weightcache" / "native")
    _unfold(native / "daemon", REPO / "weightcache" / "native" / "daemon")
    (native / "daemon" / "_planted.py").write_text("from ..engine import participant\n")
    result = layering.run_in(root, capture=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "weightcache.native.daemon._planted -> weightcache.native.engine.participant" in (
        result.stdout.replace("\n", " ").replace("  ", " "))
    assert "1 broken" in result.stdout


def test_the_mirror_maps_what_setup_py_installs():
    assert layering.package_roots() == {
        "weightcache": "weightcache",
        "weightcache.operator": "operator",
        "weightcache.agent": "agent",
    }
