"""The engine-facing API of the native weight cache: the one import an engine needs.

    from weightcache.client import load_state_dict, materialize
    from weightcache.client import from_pretrained      # transformers (the `transformers` extra)
    from weightcache.client import follow_updates, ModelGate   # in-place updates

This module is the stable face; the implementation lives in `weightcache.native.engine` (and
`push_update` in `weightcache.native.coordinator`) and may move. It imports torch only through
those modules, never the operator or the node agent;
transformers is imported only when `from_pretrained` is called.
"""

from typing import Any

from weightcache.native.coordinator import push_update  # in-place updates (docs/updates.md)
from weightcache.native.engine.attach import *  # noqa: F403
from weightcache.native.engine.attach import __all__ as _native_all
from weightcache.native.engine.participant import ModelGate, UpdateParticipant, follow_updates


def from_pretrained(model_dir: Any, **options: Any) -> Any:
    """A transformers model with its weights from the cache: see
    `weightcache.integrations.transformers.from_pretrained`."""
    from weightcache.integrations.transformers import from_pretrained as build

    return build(model_dir, **options)


__all__ = [
    *_native_all, "from_pretrained", "ModelGate", "UpdateParticipant", "follow_updates",
    "push_update",
]
