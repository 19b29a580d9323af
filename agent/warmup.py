"""The node's warmup directory of this cache: prepared before the daemons start, measured for
status and metrics, old identities pruned once the group is Ready (docs/warmup.md).

Everything in it is code or tuning an engine loads (compiled kernels, autotune tables), so
each level is checked the way the daemons check their socket directory: a real directory
(never a symlink), owned by our uid, 0700. A directory that fails the checks is not used:
the daemons then warm up in their pod's private /tmp, exactly as without this feature, and
the Status says why.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from weightcache.agent.config import AgentConfig
from weightcache.contracts import warmup as contract
from weightcache.native.shared import security

log = logging.getLogger("weightcache.agent.warmup")
# The per-rank FlashInfer tables `vllm preload` writes and engines read (v1 layout) and the
# entries of FlashInfer's v2 store (world size 1): what counts as an autotune hit or miss.
AUTOTUNE_PREFIX = "autotune_configs_"


@dataclass
class WarmupState:
    """What the Status and the metrics report of the directory."""

    path: str = ""  # the identity directory ("" when not in use)
    identity: str = ""
    unsafe: str = ""  # why the directory is not used
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    scanned_at: float = 0.0
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


def prepare(cfg: AgentConfig) -> WarmupState:
    """Create and check `<cacheDir>/<identity>/<kind>`; the state says whether it is usable."""
    spec = cfg.spec
    state = WarmupState()
    if not spec.warmup.enabled:
        state.unsafe = "disabled (spec.warmup.enabled: false)"
        return state
    state.identity = contract.identity(spec, cfg.plan.uid)
    root = Path(str(spec.warmup.cache_dir))
    target = root / state.identity
    try:
        for path in (root, target, *(target / kind for kind in contract.KINDS)):
            security.prepare_socket_dir(path, make_private=True)
    except (security.SecurityError, OSError) as exc:
        state.unsafe = f"warmup directory {root} refused: {exc}"
        log.warning("%s; the daemons warm up without it (set runAs or fix the hostPath owner)",
                    state.unsafe)
        return state
    state.path = str(target)
    return state


def prune(state: WarmupState, cache_dir: str) -> list[str]:
    """Remove the identity directories of earlier models (ours, real directories only)."""
    removed: list[str] = []
    if not state.path:
        return removed
    try:
        entries = list(os.scandir(cache_dir))
    except OSError as exc:
        log.warning("cannot list %s to prune old identities: %s", cache_dir, exc)
        return removed
    for entry in entries:
        if entry.name == state.identity or not contract.IDENTITY_RE.match(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        # rmtree never follows symlinks inside the tree (fd-based on Linux).
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.name)
    if removed:
        log.info("pruned warmup directories of earlier identities: %s", ", ".join(removed))
    return removed


def _files(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under `path` with its lstat (symlinks never followed)."""
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    elif stat.S_ISREG(st.st_mode):
                        yield entry.path, st
        except OSError:
            continue


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path`."""
    return sum(st.st_size for _, st in _files(path))


def autotune_tables(path: str) -> dict[str, tuple[int, int]]:
    """FlashInfer autotune tables under the identity dir: relative path -> (size, mtime_ns)."""
    return {os.path.relpath(p, path): (st.st_size, st.st_mtime_ns)
            for p, st in _files(path) if _is_table(p)}


def _is_table(path: str) -> bool:
    name = os.path.basename(path)
    if name.startswith(AUTOTUNE_PREFIX) and name.endswith(".json"):
        return True
    parts = path.split(os.sep)
    return name.endswith(".json") and "entries" in parts and "autotune" in parts


def scan(state: WarmupState) -> None:
    """Measure the directory, by kind."""
    if not state.path:
        return
    sizes = {kind: tree_bytes(os.path.join(state.path, kind)) for kind in contract.KINDS}
    with state.lock:
        state.bytes_by_kind = sizes
        state.scanned_at = time.time()


def count_autotune(state: WarmupState, before: dict[str, tuple[int, int]],
                   after: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Hits and misses of one daemon start, from the tables before the launch and after READY.

    vLLM logs no hit or miss for these tables, but saves one only when its tuner ran
    (kernel_warmup.py: `if tuner is dirty: save`): a table present before and unchanged
    after is a hit, a new or rewritten one a miss (tuned, or adopted from a seed peer)."""
    hits = sum(1 for key, value in after.items() if before.get(key) == value)
    misses = sum(1 for key, value in after.items() if before.get(key) != value)
    with state.lock:
        state.hits["flashinfer_autotune"] = state.hits.get("flashinfer_autotune", 0) + hits
        state.misses["flashinfer_autotune"] = (
            state.misses.get("flashinfer_autotune", 0) + misses)
    return hits, misses


class Watch:
    """Drives the scans from the agent's main loop: a snapshot of the tables at each launch,
    the count, a scan and the prune when the group becomes ready, a scan every `period_s`."""

    def __init__(self, state: WarmupState, cache_dir: str, period_s: float = 60.0) -> None:
        self.state = state
        self.cache_dir = cache_dir
        self.period_s = period_s
        self._before: dict[str, tuple[int, int]] | None = None
        self._was_ready = False
        self._pruned = False
        self._last_scan = 0.0

    def launched(self) -> None:
        """Called by the supervisor right before it starts the daemons."""
        if self.state.path:
            self._before = autotune_tables(self.state.path)
        self._was_ready = False

    def tick(self, ready: bool) -> None:
        if not self.state.path:
            return
        now = time.monotonic()
        if ready and not self._was_ready:
            if self._before is not None:
                hits, misses = count_autotune(self.state, self._before,
                                              autotune_tables(self.state.path))
                log.info("warmup cache %s: %d autotune table(s) reused, %d written",
                         self.state.path, hits, misses)
                self._before = None
            if not self._pruned:
                prune(self.state, self.cache_dir)
                self._pruned = True
            self._last_scan = 0.0
        self._was_ready = ready
        if now - self._last_scan >= self.period_s or not self._last_scan:
            scan(self.state)
            self._last_scan = now
