"""The engine-facing API of the native weight cache: the one import an engine needs.

    from weightcache.client import load_state_dict, materialize
    from weightcache.client import follow_updates, ModelGate   # in-place updates

This module is the stable face; the implementation lives in `weightcache.native.client` and
may move. It imports torch only through that module, never the operator or the node agent.
"""

from weightcache.native.client import *  # noqa: F403
from weightcache.native.client import __all__ as _client_all
from weightcache.native.updates import (  # in-place updates (docs/updates.md)
    ModelGate,
    UpdateParticipant,
    follow_updates,
    push_update,
)

__all__ = [*_client_all, "ModelGate", "UpdateParticipant", "follow_updates", "push_update"]
