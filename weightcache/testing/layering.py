"""Run the import contract (`.importlinter`) against the package as it is installed.

setup.py installs `operator/` as `weightcache.operator` and `agent/` as `weightcache.agent`
(`package_dir`); an editable install resolves them with an import hook. import-linter's graph
builder (grimp) finds a package's modules by walking the one folder `importlib` reports for it,
so against the source tree it sees only `weightcache/` and calls `weightcache.operator` missing.
This mirrors the installed package in a temporary folder (symlinks: every entry of
`weightcache/`, plus each mapped folder at its import name, read from setup.py's `ROOTS`) and
runs `lint-imports` there, so the contracts cover exactly the modules a wheel ships.

    python -P -m weightcache.testing.layering   # exit status of lint-imports

(`-P`: the repository root must not come first on sys.path, its `operator/` would shadow the
standard library's `operator`.)
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_roots(repo: Path = REPO) -> dict[str, str]:
    """setup.py's `ROOTS` (import name -> folder), read without running setup()."""
    tree = ast.parse((repo / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{repo / 'setup.py'} defines no ROOTS mapping")


def mirror(dest: Path, repo: Path = REPO) -> Path:
    """Build `dest/<top package>` as the installed package looks; return `dest`."""
    roots = package_roots(repo)
    top = min(roots, key=len)
    base = dest / top
    base.mkdir(parents=True)
    for entry in (repo / roots[top]).iterdir():
        if entry.name != "__pycache__":
            (base / entry.name).symlink_to(entry)
    for name, folder in roots.items():
        if name == top:
            continue
        link = dest.joinpath(*name.split("."))
        if os.path.lexists(link):
            raise RuntimeError(f"{roots[top]}/{link.name} would hide the mapped folder {folder}/")
        link.symlink_to(repo / folder)
    return dest


def lint_imports_command() -> list[str]:
    script = Path(sys.executable).with_name("lint-imports")
    found = str(script) if script.exists() else shutil.which("lint-imports")
    if not found:
        raise RuntimeError("lint-imports is not installed: pip install -e '.[test]'")
    return [found, "--no-cache", "--no-logo"]


def run_in(root: Path, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """lint-imports over the mirror at `root` (its folder first on the import path).

    The contract file is linked into `root`, where lint-imports looks for it by default (the
    `--config` option is deprecated in newer import-linter releases).
    """
    config = root / ".importlinter"
    if not os.path.lexists(config):
        config.symlink_to(REPO / ".importlinter")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        lint_imports_command(), cwd=root, env=env, text=True, capture_output=capture,
        timeout=300, check=False,
    )


def run(capture: bool = False) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="weightcache-layering-") as tmp:
        return run_in(mirror(Path(tmp)), capture)


def main() -> int:
    return run().returncode


if __name__ == "__main__":
    sys.exit(main())
