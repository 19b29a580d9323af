"""Maps the top-level folders into one import namespace.

`operator/` is also a standard-library module name, so it must never be importable as a
top-level package: it is installed as `weightcache.operator`, and `agent/` as
`weightcache.agent`. Subpackages are discovered from the tree so nobody has to keep a list.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "weightcache": "weightcache",
    "weightcache.operator": "operator",
    "weightcache.agent": "agent",
}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        base = Path(folder)
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            found.append(".".join([name, *rel.parts]) if rel.parts else name)
    return found


setup(
    packages=_packages(),
    package_dir=ROOTS,
    package_data={"weightcache.contracts": ["proto/*.proto"], "weightcache.operator": ["*.json"]},
    include_package_data=True,
)
