"""Pausing Python's cyclic garbage collector while an attach builds its objects.

An attach allocates several objects per tensor (header entries, layout entries, views) and
frees almost none, which is exactly what triggers the collector's generation-0 and then full
passes: with it running, attach time grew faster than the tensor count (3,000 tensors: 161 ms
against 60 ms with it paused, on the CPU daemon). Nothing an attach builds is cyclic garbage,
so the pass finds nothing. Attaches in several threads share one pause (a count): the
collector runs again, if it was on before the first, once the last one ends.

Re-enabling alone would only defer that pass: the young generation's count has grown by every
object made meanwhile, so the next allocation would scan them all (about 1 us per tensor). At
the end of the pause the young objects are therefore moved to the oldest generation
unscanned (`gc.freeze()` then `gc.unfreeze()`, which also resets the young count), where an
engine's long-lived weights belong; a later full collection still sees every one of them.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.freeze()  # every tracked object into the permanent generation, count 0...
                gc.unfreeze()  # ...and back into the oldest one: young ones promoted unscanned
                gc.enable()
