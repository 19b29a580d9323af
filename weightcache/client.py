"""The engine-facing API of the native weight cache: the one import an engine needs.

    from weightcache.client import load_state_dict, materialize

This module is the stable face; the implementation lives in `weightcache.native.client` and
may move. It imports torch only through that module, never the operator or the node agent.
"""

from weightcache.native.client import *  # noqa: F403
from weightcache.native.client import __all__  # noqa: F401
