"""`python -m weightcache.native.daemon`: one daemon rank, as the launcher starts it.

The import set's read-ahead starts before anything else is imported: the rank's own modules
(and numpy, which they import) are in the set (importset.py).
"""

import sys
import time

exec_at = time.monotonic()  # READY's `marks`: how long the interpreter's start took is seen

from ..shared.importset import start_prefetch  # noqa: E402

started = start_prefetch()

from .rank import main  # noqa: E402  (after the read-ahead has started)

sys.exit(main(prefetch=started, exec_at=exec_at))
