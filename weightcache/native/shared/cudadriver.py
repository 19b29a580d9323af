"""Which binding of the CUDA driver API this process calls: cuda-python's, or the project's own
ctypes binding of the calls it makes (`_libcuda`).

Why there are two: an engine's first attach in a new process asks the driver for its device's
UUID and then maps the daemon's arena, and the first of those imported `cuda.bindings.driver`,
a large Cython module: 10-17 ms with cuda-bindings 13.3.1 on the development machine (torch
imported first), while the whole first attach of the 291-tensor shard took 29.6-42.7 ms on an
H100 (zero copy, run100), its plan 21-28 ms of that.
torch has loaded `libcuda.so.1` by then, so the ctypes binding costs a `dlopen` of a loaded
library and two dozen `dlsym`s. Both are called the same way (`_libcuda`'s docstring), so
every caller takes `driver()` and never knows which it has.

`WEIGHTCACHE_CUDA_DRIVER` chooses: `bindings` (the default) or `ctypes`. The ctypes binding
stays opt-in until it has run the GPU suite on a device (it has run only against cuda.h's
layouts, the real bindings' structs and a stand-in driver); where `libcuda.so.1` cannot be
opened or lacks a symbol, `ctypes` falls back to the bindings. A value that names neither is
the default, with a warning: the knob tunes speed only.

Calls `_libcuda` does not bind (the daemon's staging: host registration, 2D copies) take
`bindings()` directly: they are the daemon's, off an engine's clock.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

DRIVER_ENV = "WEIGHTCACHE_CUDA_DRIVER"
BINDINGS, CTYPES = "bindings", "ctypes"
CHOICES = (BINDINGS, CTYPES)


def choice() -> str:
    """`WEIGHTCACHE_CUDA_DRIVER`, or the default where it names no binding."""
    text = os.environ.get(DRIVER_ENV, "").strip().lower()
    if not text:
        return BINDINGS
    if text not in CHOICES:
        log.warning("weightcache: %s=%r is none of %s; using %s", DRIVER_ENV, text,
                    ", ".join(CHOICES), BINDINGS)
        return BINDINGS
    return text


@functools.cache
def bindings() -> Any:
    """cuda-python's driver module (`cuda.bindings.driver`; older releases: `cuda.cuda`);
    ImportError where cuda-python is missing."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        from cuda import cuda as cu  # cuda-python < 12.6 layout
    return cu


@functools.cache
def driver() -> Any:
    """The binding `choice()` names, loaded once per process; ImportError where none is
    usable (no cuda-python, and ctypes not chosen or not loadable)."""
    if choice() == CTYPES:
        from . import _libcuda  # only where chosen: its enums and structs cost ~1.4 ms

        try:
            _libcuda.load()
            return _libcuda
        except _libcuda.LibcudaUnavailable as exc:
            log.info("weightcache: the ctypes CUDA driver binding is unavailable (%s);"
                     " using cuda-python's", exc)
    return bindings()


def forget() -> None:
    """Choose again on the next call (tests that change `WEIGHTCACHE_CUDA_DRIVER`)."""
    driver.cache_clear()
    bindings.cache_clear()
