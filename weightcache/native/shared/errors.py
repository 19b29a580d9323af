"""The error root of the native cache, and the errors both of its sides raise.

`WeightCacheError` lives here, import-free, so that modules the engine builds on (checkpoint
parsing, the socket connection) raise subclasses of it without importing torch: the
engine-facing contract is that a load either returns weights or raises a WeightCacheError,
whatever the input. Like every error this project raises on purpose, it is a `ProjectError`.
The other native errors (`ProtocolError`, `SecurityError`, `ShardingError`...) live beside the
module that raises them, and are `ProjectError`s too.
"""

from __future__ import annotations

from typing import Any

from weightcache.errors import ProjectError


class WeightCacheError(ProjectError, RuntimeError):
    """The cache could not serve this load (the message says why)."""

    reason = "error"


class DaemonUnavailableError(WeightCacheError):
    reason = "unavailable"


class DaemonTimeoutError(DaemonUnavailableError):
    """Connected, but the daemon did not answer in time (stopped, hung, or very busy)."""


class DaemonLoadingError(DaemonUnavailableError):
    """No socket yet, but a daemon holds its lock: it is loading (see `presence.py`)."""


class NotReadyError(WeightCacheError):
    reason = "not_ready"


class ReleasedError(WeightCacheError):
    reason = "released"


class FingerprintMismatchError(WeightCacheError):
    reason = "fingerprint_mismatch"

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


class DeviceMismatchError(WeightCacheError):
    reason = "device_mismatch"


class CacheSecurityError(WeightCacheError):
    reason = "security"


class CacheProtocolError(WeightCacheError):
    reason = "protocol"


class DaemonError(WeightCacheError):
    """The daemon answered with an error code this client has no better exception for."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = code


class DiskFallbackError(WeightCacheError):
    """The cache could not serve a load and the disk fallback failed too.

    With fallback on, this is the one error a load raises once the cache has said no: the
    disk's own error (out of memory, a file that cannot be read...) is its `__cause__`, and
    `cache_reason` keeps why the cache path was left ("protocol: ...", "unavailable: ...").
    """

    reason = "disk_fallback"

    def __init__(self, message: str, cache_reason: str) -> None:
        super().__init__(message)
        self.cache_reason = cache_reason


class UpdateError(ProjectError):
    """An in-place update did not happen, or (`broken`) could not be kept whole.

    One class for both ends: a daemon rank refuses a phase with it (its `code` and `detail`
    become the error reply), and the coordinator raises it when the group did not switch.
    """

    def __init__(self, code: str, message: str, *, broken: bool = False,
                 detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.broken, self.detail = code, broken, detail or {}
