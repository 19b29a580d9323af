"""The transport seam: how one rank's arena is allocated, exported and mapped.

A daemon rank keeps its whole shard in ONE contiguous range (an `Arena`: one allocation, or
with `cuda_vmm` a few side by side), so an engine maps one handle (or a few) instead of
hundreds. A `Transport` knows how to allocate such an arena on a
device, describe it as JSON-able metadata plus file descriptors (sent with SCM_RIGHTS), and
map it again on the client side (`Imported`). The protocol never carries anything but that
metadata and the fds, so adding a transport never touches the daemon or the client.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from weightcache.errors import ProjectError

# Tensor offsets inside an arena are aligned to this many bytes (CUDA's allocation granularity
# for vectorised kernels is 256; it also keeps every dtype naturally aligned).
ARENA_ALIGN = 256


class TransportError(ProjectError, RuntimeError):
    """A transport cannot allocate, export or map an arena."""


class TransportUnavailableError(TransportError):
    """The requested transport is not registered or cannot run on this device."""


@runtime_checkable
class Arena(Protocol):
    """Daemon side: one contiguous range per rank."""

    nbytes: int

    def tensor(self) -> torch.Tensor:
        """Flat uint8 view of the whole arena."""
        ...

    def export(self) -> tuple[dict[str, Any], list[int]]:
        """(JSON-able metadata, fds to pass). The fds stay owned by the arena."""
        ...

    def close(self) -> None:
        """Free the memory (idempotent)."""
        ...


@runtime_checkable
class Imported(Protocol):
    """Client side: a mapped arena."""

    def tensor(self) -> torch.Tensor:
        """Flat uint8 tensor over the mapped arena."""
        ...

    def close(self) -> None:
        """Drop the mapping; tensors still viewing it keep it alive where the transport can."""
        ...


@runtime_checkable
class Transport(Protocol):
    name: str

    def available(self, device: torch.device) -> bool: ...

    def allocate(self, nbytes: int, device: torch.device) -> Arena: ...

    def attach(self, meta: dict[str, Any], fds: list[int], device: torch.device) -> Imported:
        """Map an exported arena. Takes ownership of `fds` (closes them when done)."""
        ...


def align_up(value: int, align: int = ARENA_ALIGN) -> int:
    return (value + align - 1) // align * align
