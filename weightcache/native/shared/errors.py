"""The one base class of every error the native cache's client side raises.

It lives apart from client.py so that modules the client builds on (checkpoint parsing) can
raise subclasses of it without importing torch: the engine-facing contract is that a load
either returns weights or raises a WeightCacheError, whatever the input.
"""

from __future__ import annotations


class WeightCacheError(RuntimeError):
    """The cache could not serve this load (the message says why)."""

    reason = "error"
