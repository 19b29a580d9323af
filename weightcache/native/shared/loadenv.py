"""The load's knobs in the environment, parsed in one place (torch-free).

Two readers, two rules:
- a daemon's rank calls `check()` before it loads, and refuses a bad value with a line that names
  it (exit 2), so an operator's typo is seen at once;
- every load reads the knobs through the getters here, which take a bad value as the default. The
  same loader serves an engine's fallback to the disk, and an engine that would have loaded from
  disk must never fail on a knob that only tunes how it reads.

The early reads' budget (`earlyread.BUDGET_ENV`) is a rank's alone and stays with them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from weightcache import constants

MiB = 1 << 20
PAGE = 4096
DEFAULT_CHUNK = 16 * MiB  # the read size: a power of two (torch's pinned-memory size classes)
THREADS_ENV = "WEIGHTCACHE_LOAD_THREADS"
CHUNK_ENV = "WEIGHTCACHE_LOAD_CHUNK_MIB"
DIRECT_ENV = "WEIGHTCACHE_LOAD_DIRECT"
IO_PRIORITY_ENV = "WEIGHTCACHE_LOAD_IO_PRIORITY"
YIELD_ENV = "WEIGHTCACHE_LOAD_YIELD"
START_GENTLE_ENV = "WEIGHTCACHE_LOAD_START_GENTLE_S"
HOLD_ENV = "WEIGHTCACHE_LOAD_HOLD_S"
HOLD_MAX_ENV = "WEIGHTCACHE_LOAD_HOLD_MAX_S"
YIELD_READS_ENV = "WEIGHTCACHE_LOAD_YIELD_READS"
HOT_STEP_ENV = "WEIGHTCACHE_LOAD_HOT_STEP_MIB"
MAX_HOT_STEP_MIB = 256
HEAD_START_ENV = "WEIGHTCACHE_LOAD_HEAD_START_MIB"
DEFAULT_HEAD_START_MIB = 512  # headstart.py: about what the disk reads before a rank's first read
MAX_HEAD_START_MIB = 16 << 10
HEAD_START_COLD_ENV = "WEIGHTCACHE_LOAD_HEAD_START_COLD"  # headstart.py: ask where the set is cold

# The import set's readers (importset.prefetch_threads): checked here with the other knobs.
IMPORT_SET_THREADS_ENV = constants.ENV_IMPORT_SET_THREADS
MAX_IMPORT_SET_THREADS = 256

T = TypeVar("T")


def direct_mode(value: str | bool | None) -> bool | str:
    """`WEIGHTCACHE_LOAD_DIRECT`: auto (default), 1/true/yes (always), 0/false/no (never)."""
    if isinstance(value, bool):
        return value
    text = (value or "auto").strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    if text == "auto":
        return "auto"
    raise ValueError(f"{DIRECT_ENV}={value!r}: use auto, 1 or 0")


def io_priority(value: str | None) -> bool:
    """`WEIGHTCACHE_LOAD_IO_PRIORITY`: normal (default) or idle (all of the fill's reads go
    behind every other process's, not only its gentle ones: diskshare.py)."""
    text = (value or "normal").strip().lower()
    if text in {"normal", "idle"}:
        return text == "idle"
    raise ValueError(f"{IO_PRIORITY_ENV}={value!r}: use normal or idle")


def yield_mode(value: str | None) -> bool:
    """`WEIGHTCACHE_LOAD_YIELD`: auto (default: the load yields the disk while other programs
    fault pages in, diskshare.py) or off."""
    text = (value or "").strip().lower() or "auto"
    if text in {"auto", "on", "1", "true", "yes"}:
        return True
    if text in {"off", "0", "false", "no"}:
        return False
    raise ValueError(f"{YIELD_ENV}={value!r}: use auto or off")


def flag(name: str, default: bool) -> bool:
    """A yes/no knob (1/true/yes, 0/false/no); a bad value is the default: a knob that only
    tunes speed never fails a start."""
    text = os.environ.get(name, "").strip().lower()
    if text in {"1", "true", "yes"}:
        return True
    if text in {"0", "false", "no"}:
        return False
    return default


def whole_number(name: str, value: str, minimum: int, hint: str = "a whole number") -> int:
    """`value` as an int of at least `minimum`; ValueError naming the knob otherwise."""
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: use {hint} >= {minimum}") from None
    if number < minimum:
        raise ValueError(f"{name}={value!r}: use {hint} >= {minimum}")
    return number


def _positive(name: str, value: str | None, default: int) -> int:
    if value is None or not value.strip():
        return default
    return whole_number(name, value, 1)


def _bounded(name: str, value: str | None, default: int, minimum: int, maximum: int,
             unit: str = "") -> int:
    """A whole number from `minimum` to `maximum` (in `unit`, said in the error); unset,
    `default`; ValueError naming the knob otherwise."""
    if value is None or not value.strip():
        return default
    number = whole_number(name, value, minimum, f"a whole number of {unit}" if unit else
                          "a whole number")
    if number > maximum:
        raise ValueError(f"{name}={value!r}: use {minimum} to {maximum}"
                         + (f" ({unit})" if unit else ""))
    return number


def _chunk(value: str | None) -> int:
    chunk = _positive(CHUNK_ENV, value, DEFAULT_CHUNK // MiB) * MiB
    return max(4 * PAGE, chunk - chunk % PAGE)


def _hot_step(value: str | None, default: int) -> int:
    if value is None or not value.strip():
        return default
    return _bounded(HOT_STEP_ENV, value, 0, 1, MAX_HOT_STEP_MIB, "MiB") * MiB  # set: no default


def _head_start(value: str | None) -> int:
    return _bounded(HEAD_START_ENV, value, DEFAULT_HEAD_START_MIB, 0, MAX_HEAD_START_MIB,
                    "MiB") * MiB


def _import_set_threads(value: str | None, default: int) -> int:
    return _bounded(IMPORT_SET_THREADS_ENV, value, default, 1, MAX_IMPORT_SET_THREADS)


def check() -> None:
    """Every knob as the loader will read it; ValueError naming the first bad one."""
    _positive(THREADS_ENV, os.environ.get(THREADS_ENV), 1)
    _chunk(os.environ.get(CHUNK_ENV))
    _hot_step(os.environ.get(HOT_STEP_ENV), MiB)
    _head_start(os.environ.get(HEAD_START_ENV))
    _import_set_threads(os.environ.get(IMPORT_SET_THREADS_ENV), 1)
    direct_mode(os.environ.get(DIRECT_ENV))
    io_priority(os.environ.get(IO_PRIORITY_ENV))
    yield_mode(os.environ.get(YIELD_ENV))


def _lenient(parse: Callable[[], T], default: T) -> T:
    try:
        return parse()
    except ValueError:
        return default


def positive(name: str, default: int) -> int:
    """A whole-number knob of at least 1; unset or bad, `default`."""
    return _lenient(lambda: _positive(name, os.environ.get(name), default), default)


def threads(default: int) -> int:
    """`WEIGHTCACHE_LOAD_THREADS`, else `default`."""
    return positive(THREADS_ENV, default)


def _seconds(name: str, default: float) -> float:
    """Seconds from 0 to 60 in `name`, else `default`: a knob that only tunes speed never
    fails a start."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if 0 <= value <= 60 else default


def start_gentle(default: float) -> float:
    """`WEIGHTCACHE_LOAD_START_GENTLE_S`: seconds a rank's reads stay gentle from their start
    (diskshare.py), else `default`."""
    return _seconds(START_GENTLE_ENV, default)


def hold(default: float) -> float:
    """`WEIGHTCACHE_LOAD_HOLD_S`: the least a load stays gentle after a fault (a blip's hold,
    and the start of a hold that grows: diskshare.py), else `default`."""
    return _seconds(HOLD_ENV, default)


def hold_max(default: float) -> float:
    """`WEIGHTCACHE_LOAD_HOLD_MAX_S`: the longest a load stays gentle after another program's
    last fault, however long that program has been starting (diskshare.py), else `default`."""
    return _seconds(HOLD_MAX_ENV, default)


def chunk() -> int:
    """The fill's read size (`WEIGHTCACHE_LOAD_CHUNK_MIB`), page-aligned. The early reads cut
    their jobs with it too, so both must read it the same way."""
    return _lenient(lambda: _chunk(os.environ.get(CHUNK_ENV)), DEFAULT_CHUNK)


def hot_step(default: int) -> int:
    """`WEIGHTCACHE_LOAD_HOT_STEP_MIB`: the piece a page-cache read is copied and then hashed
    in (coldload.HOT_STEP), 1 to 256 MiB, else `default`."""
    return _lenient(lambda: _hot_step(os.environ.get(HOT_STEP_ENV), default), default)


def head_start() -> int:
    """`WEIGHTCACHE_LOAD_HEAD_START_MIB`: the checkpoint's bytes a launcher asks the disk for
    before its ranks read (headstart.py), 0 for none; unset or bad, DEFAULT_HEAD_START_MIB."""
    return _lenient(lambda: _head_start(os.environ.get(HEAD_START_ENV)),
                    DEFAULT_HEAD_START_MIB * MiB)


def import_set_threads(default: int) -> int:
    """`WEIGHTCACHE_IMPORT_SET_THREADS`: a deep import-set prefetch's readers
    (importset.prefetch_threads), 1 to MAX_IMPORT_SET_THREADS; unset or bad, `default`."""
    return _lenient(lambda: _import_set_threads(os.environ.get(IMPORT_SET_THREADS_ENV),
                                                default), default)


def direct() -> bool | str:
    """`WEIGHTCACHE_LOAD_DIRECT`, else auto."""
    return _lenient(lambda: direct_mode(os.environ.get(DIRECT_ENV)), "auto")


def idle() -> bool:
    """`WEIGHTCACHE_LOAD_IO_PRIORITY`, else normal."""
    return _lenient(lambda: io_priority(os.environ.get(IO_PRIORITY_ENV)), False)


def yielding() -> bool:
    """`WEIGHTCACHE_LOAD_YIELD`, else auto."""
    return _lenient(lambda: yield_mode(os.environ.get(YIELD_ENV)), True)
