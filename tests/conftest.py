"""Suite-wide: the daemons the tests start keep their import set (what a rank's start read,
weightcache/native/shared/importset.py) in a temporary directory of this run, not in the
user's cache directory, so a test run leaves nothing outside its own files."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "WEIGHTCACHE_IMPORT_SET" not in os.environ:
    _dir = tempfile.mkdtemp(prefix="wc-import-set-")
    atexit.register(shutil.rmtree, _dir, True)
    os.environ["WEIGHTCACHE_IMPORT_SET"] = os.path.join(_dir, "import-set.json")
