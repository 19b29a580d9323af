"""Transport registry: `get_transport(name)` and `default_transport(device)`.

Transports live in sibling modules that expose a module-level `TRANSPORT` object (or call
`register`). Modules are imported lazily, so a CPU-only install never imports CUDA bindings;
a CUDA transport module that cannot import its bindings (no `cuda-python`) raises ImportError
and is simply not registered.

May import: torch, the CUDA driver bindings (lazily, in the CUDA modules only) and
`weightcache.native.shared.gpu`; nothing else of the package, so the daemon and the client depend on
transports and not the other way round.
"""

from __future__ import annotations

import importlib

import torch

from .base import (
    ARENA_ALIGN,
    Arena,
    Imported,
    Transport,
    TransportError,
    TransportUnavailableError,
    align_up,
)

__all__ = [
    "ARENA_ALIGN",
    "Arena",
    "Imported",
    "Transport",
    "TransportError",
    "TransportUnavailableError",
    "align_up",
    "available_transports",
    "default_transport",
    "get_transport",
    "load_all",
    "register",
]

# name -> module path; order is the preference order of `default_transport`.
_MODULES: dict[str, str] = {
    "cuda_vmm": "weightcache.native.shared.transport.cuda_vmm",
    "cuda_ipc": "weightcache.native.shared.transport.cuda_ipc",
    "memfd": "weightcache.native.shared.transport.memfd",
}
_REGISTRY: dict[str, Transport] = {}
_FAILED: dict[str, str] = {}


def register(transport: Transport) -> None:
    _REGISTRY[transport.name] = transport


def _load(name: str) -> Transport | None:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _FAILED or name not in _MODULES:
        return None
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as exc:
        _FAILED[name] = str(exc)
        return None
    found = getattr(module, "TRANSPORT", None)
    if found is not None:
        register(found)
    return _REGISTRY.get(name)


def load_all(cuda: bool = True) -> list[str]:
    """Import every transport module now, and with `cuda` the CUDA driver bindings where
    installed (a CPU rank never uses them), without touching a device; the names that loaded.

    Why: a rank imports its transport only when it allocates its arena, after its start, and a
    node's first start with the agent image's seed found these files missing from the seed:
    read cold behind the checkpoint's reads, the allocate phase took 0.12-1.62 s in every such
    start measured (runs 60-87, H100), 0.002-0.006 s in every other. A rank calls this with
    its other imports (`rank.import_for_fill`), and the seed's recording calls the same."""
    names = [name for name in _MODULES if _load(name) is not None]
    if cuda:
        from . import _cuda  # after the modules: a CUDA one has imported it already

        _cuda.bindings_importable()
    return names


def get_transport(name: str) -> Transport:
    transport = _load(name)
    if transport is None:
        why = _FAILED.get(name, "no such transport")
        raise TransportUnavailableError(f"transport {name!r} is not available: {why}")
    return transport


def available_transports(device: torch.device | str) -> list[str]:
    """Names of the transports that can serve `device`, in preference order."""
    device = torch.device(device)
    names = list(_MODULES) + [n for n in _REGISTRY if n not in _MODULES]
    found = []
    for name in names:
        transport = _load(name)
        if transport is not None and transport.available(device):
            found.append(name)
    return found


def default_transport(device: torch.device | str) -> Transport:
    names = available_transports(device)
    if not names:
        raise TransportUnavailableError(f"no transport can serve device {device}")
    return get_transport(names[0])
