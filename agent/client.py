"""Deprecated import path of the engine-side client: use `weightcache.client` instead.

Kept as a thin re-export so engines written against `weightcache.agent.client` keep working;
it will be removed in a later minor version. The node agent itself never imports it.
"""

import warnings

from weightcache.native.engine.attach import *  # noqa: F403
from weightcache.native.engine.attach import __all__  # noqa: F401

warnings.warn(
    "weightcache.agent.client is deprecated; import weightcache.client instead",
    DeprecationWarning,
    stacklevel=2,
)
