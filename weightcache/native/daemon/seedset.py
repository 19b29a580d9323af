"""`weightcache import-set record PATH`: the import set a node's first start reads ahead.

A rank writes down what its start read (importset.py) and reads it ahead at its next start; a
node's first start has nothing to read, and it is the slowest start of all (every library from
a cold disk, behind the checkpoint's reads). This command records the set where the libraries
are installed, typically the agent image's build (Dockerfile.agent), by importing what a rank
imports before its fill (`rank.import_for_fill`: torch, the fill, the server, the arena's
transports and the driver bindings) under the same audit hook a rank's start runs, after
dropping the libraries from the page cache, so that the set is what a cold start reads, not
every page an installation left in memory. No device is touched: the driver's libraries are the
node's, and the node's own set adds them at its first start. The file is written 0644 in a
directory others may enter (the image's build runs as root, its ranks as another user);
`WEIGHTCACHE_IMPORT_SET_SEED` names it to the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import sysconfig
from pathlib import Path

from weightcache.native.shared import importset


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache import-set",
        description="Record the import set a rank's first start on a node reads ahead "
                    "(WEIGHTCACHE_IMPORT_SET_SEED names it).")
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="import what a rank imports, then write the set")
    rec.add_argument("path", type=Path, help="where to write it (e.g. in the agent image)")
    return parser


def evict_libraries() -> int:
    """Drop the interpreter's and the installed packages' files from the page cache (those not
    mapped by a running process): the files that were written or read here before. A set is
    the pages resident after the start, so a seed recorded over a warm page cache (an image's
    build has just installed every library) names whole libraries: on the development machine
    302 MB against the 144 MB a node's own cold start recorded, and the seeded start read it
    all, slower than a start with no set at all. Evicted first, what is resident after the
    import is what a cold start faults in and reads ahead, as on a new node. How many files."""
    os.sync()  # written pages are dropped only once clean
    roots = {sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(str(Path(__file__).resolve().parents[2]))  # this package, wherever it lies
    seen: set[str] = set()
    count = 0
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        for dirpath, dirnames, filenames in os.walk(root):
            real = os.path.realpath(dirpath)
            if real in seen:
                dirnames.clear()
                continue
            seen.add(real)
            for name in filenames:
                try:
                    fd = os.open(os.path.join(dirpath, name),
                                 os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        count += 1
                except OSError:
                    pass
                finally:
                    os.close(fd)
    return count


def record_seed(path: Path) -> dict[str, object] | None:
    """Import the rank's modules under the start's audit hook, from a page cache without the
    libraries (`evict_libraries`), then write the set to `path`."""
    evict_libraries()
    importset.watch_opens()
    # What a rank imports once it holds its lock (rank.run): torch, numpy, the fill, the
    # server and the arena's transports.
    from . import rank

    rank.import_for_fill()

    return importset.record(path, shared=True, whole_seconds=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:  # before minutes of imports: a path it can never write is said at once
        args.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if not os.access(args.path.parent, os.W_OK | os.X_OK):
            raise PermissionError(f"{args.path.parent} is not writable")
    except OSError as exc:
        print(f"weightcache import-set: cannot write {args.path}: {exc}", file=sys.stderr)
        return 1
    found = record_seed(args.path)
    if found is None:
        print(f"weightcache import-set: cannot write {args.path}", file=sys.stderr)
        return 1
    files = found["files"]
    assert isinstance(files, list)
    print(json.dumps({"path": str(args.path), "files": len(files), "bytes": found["bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
