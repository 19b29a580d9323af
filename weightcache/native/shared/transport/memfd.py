"""CPU transport: the arena is an anonymous memfd; its fd travels with SCM_RIGHTS.

Why memfd and not /dev/shm: a memfd has no name anyone else can open, lives exactly as long as
an fd or a mapping refers to it, and can be sealed. After loading, the daemon seals the file
against resizing (a client truncating it would crash the daemon with SIGBUS) and, where the
kernel supports it, against new writable shared mappings (F_SEAL_FUTURE_WRITE), so engines can
read the cache but never corrupt it for each other. Clients map it MAP_PRIVATE: reads share the
daemon's pages (zero copy), a stray write lands in a private copy-on-write page.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import Any

import torch

from .base import Imported, TransportError

# Not exported by Python's fcntl module (Linux >= 5.1).
F_SEAL_FUTURE_WRITE = 0x0010
# What a client requires before it maps an fd: it cannot shrink under the mapping (a
# truncated file is SIGBUS on the next read) and nobody can write the bytes any more.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def check_seals(fd: int) -> None:
    """Refuse an fd that is not a memfd sealed against resizing and against writes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise TransportError(f"the arena fd is not a sealable memfd: {exc}") from None
    missing = REQUIRED_SEALS & ~seals
    if missing or not seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise TransportError(
            f"the arena memfd is not sealed against resizing and writes (seals {seals:#x})"
        )


def _flat(buffer: mmap.mmap) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class MemfdArena:
    """A sealed-after-load anonymous file mapped shared into the daemon."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise TransportError(f"arena size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        self._fd: int | None = os.memfd_create("weightcache-arena", flags)
        try:
            os.ftruncate(self._fd, nbytes)
            # mmap of length 0 is invalid: an empty arena has no mapping at all.
            self._map: mmap.mmap | None = (
                mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED) if nbytes else None
            )
            if self._map is not None and hasattr(mmap, "MADV_HUGEPAGE"):
                # 4 KiB shmem page faults cap a fresh fill at ~0.5 GB/s where measured; huge
                # pages apply where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows.
                with contextlib.suppress(OSError):
                    self._map.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:
            os.close(self._fd)
            self._fd = None
            raise TransportError(f"cannot allocate a {nbytes}-byte memfd arena: {exc}") from exc
        self._sealed = False

    def tensor(self) -> torch.Tensor:
        if self._fd is None:
            raise TransportError("arena is closed")
        return _flat(self._map) if self._map is not None else torch.empty(0, dtype=torch.uint8)

    def seal(self) -> None:
        """Forbid resizing and (kernel permitting) new writable shared mappings."""
        if self._fd is None or self._sealed:
            return
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        self._sealed = True

    def export(self) -> tuple[dict[str, Any], list[int]]:
        if self._fd is None:
            raise TransportError("arena is closed")
        self.seal()
        return {"transport": MemfdTransport.name, "nbytes": self.nbytes}, [self._fd]

    def close(self) -> None:
        if self._map is not None:
            # Tensors still viewing the mapping keep it; it is unmapped when the last one goes.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemfdImported:
    def __init__(self, fd: int, nbytes: int) -> None:
        try:
            check_seals(fd)
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise TransportError(f"memfd holds {size} bytes, table expects {nbytes}")
            self._map: mmap.mmap | None = (
                mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE) if nbytes else None
            )
        except OSError as exc:
            raise TransportError(f"cannot map the memfd arena: {exc}") from exc
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        empty = torch.empty(0, dtype=torch.uint8)
        self._tensor = _flat(self._map) if self._map is not None else empty

    def tensor(self) -> torch.Tensor:
        return self._tensor

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class MemfdTransport:
    name = "memfd"

    def available(self, device: torch.device) -> bool:
        return torch.device(device).type == "cpu" and hasattr(os, "memfd_create")

    def allocate(self, nbytes: int, device: torch.device) -> MemfdArena:
        if not self.available(device):
            raise TransportError(f"memfd arenas live in host memory, not on {device}")
        return MemfdArena(nbytes)

    def attach(self, meta: dict[str, Any], fds: list[int], device: torch.device) -> Imported:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"memfd transport expects 1 fd, got {len(fds)}")
        nbytes = meta.get("nbytes")
        if not isinstance(nbytes, int) or nbytes < 0:
            os.close(fds[0])
            raise TransportError(f"bad arena size in metadata: {nbytes!r}")
        return MemfdImported(fds[0], nbytes)


TRANSPORT = MemfdTransport()
