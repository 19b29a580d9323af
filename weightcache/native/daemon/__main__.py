"""`python -m weightcache.native.daemon`: one daemon rank, as the launcher starts it."""

import sys

from .rank import main

sys.exit(main())
