"""Supervision of one node's daemon ranks: launch, readiness, failure, restart, shutdown.

The runtime's launcher runs as one child in its own process group (its ranks are its
children), so stopping is one `killpg`. A loop thread owns every state change; gRPC and
metrics read consistent copies through `snapshot()`.

Failure policy:
- single-node group: a dead rank, a dead launcher or a load past the timeout stops the
  whole group and relaunches it after an exponential backoff. A group that fails
  `max_load_failures` times in a row without ever becoming ready makes the agent exit
  non-zero (the pod restarts and kubelet's CrashLoopBackOff makes the fault visible).
- multi-node group: ranks on other nodes share a rendezvous with ours, so the agent never
  restarts alone. It reports the failure (Status, metrics, readiness) and waits until the
  operator bumps the group epoch through `Restart(epoch)`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from weightcache.agent.config import AgentConfig
from weightcache.agent.runtimes.base import RankSpec, Runtime, http_health
from weightcache.contracts.vocabulary import (  # noqa: F401  (re-exported for main)
    EXIT_CONFIG,
    EXIT_DAEMON,
    EXIT_OK,
    EXIT_PORT,
    EXIT_RUNTIME,
)
from weightcache.errors import ProjectError
from weightcache.native.daemon.lifetime import exiting_with_parent

log = logging.getLogger("weightcache.agent.supervisor")

# Exit codes of `weightcache agent` (documented in docs/agent.md).


class State(enum.Enum):
    PENDING = 1
    LOADING = 2
    READY = 3
    FAILED = 4
    RELEASED = 5


@dataclass
class RankStatus:
    spec: RankSpec
    state: State = State.PENDING
    bytes: int = 0
    pid: int = 0
    since: float = field(default_factory=time.time)
    message: str = ""
    load_seconds: float | None = None
    stats: dict[str, Any] | None = None


@dataclass
class Snapshot:
    """A consistent copy of the supervisor's state for gRPC and metrics."""

    ranks: list[RankStatus]
    epoch: int
    restarts: int
    held: bool
    released: bool
    ready: bool
    alive: bool
    message: str


@dataclass
class Policy:
    poll_interval: float = 0.25
    probe_timeout: float = 2.0
    refresh_interval: float = 5.0  # how often ready ranks are re-probed for bytes/stats
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    max_load_failures: int = 3
    stop_grace: float = 15.0
    # A ready rank is pinged this often; LIVENESS_FAILURES unanswered pings in a row (a
    # stopped or hung process keeps its socket and watch open) count as a dead rank.
    liveness_interval: float = 1.0
    liveness_timeout: float = 1.0
    liveness_failures: int = 2


class Supervisor:
    def __init__(
        self,
        cfg: AgentConfig,
        runtime: Runtime,
        policy: Policy | None = None,
        on_fatal: Callable[[int, str], None] | None = None,
        on_change: Callable[[], None] | None = None,
        on_launch: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_launch = on_launch
        self.runtime = runtime
        self.policy = policy or Policy()
        self.on_fatal = on_fatal
        self.on_change = on_change
        self._last_seen: tuple[bool, bool] | None = None
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen[bytes] | None = None
        # Launchers being stopped: terminated outside the state lock so Status stays responsive.
        self._reaping: list[subprocess.Popen[bytes]] = []
        self._reap_lock = threading.Lock()
        self._launched_at = 0.0
        self._next_launch: float | None = time.monotonic()
        self._last_refresh = 0.0
        self._last_liveness = 0.0
        self._missed: dict[int, int] = {}
        self._watches: dict[int, socket.socket] = {}
        self._healthy = False
        self._stop_reason = ""
        self.ranks = [RankStatus(spec=r) for r in runtime.ranks()]
        self.epoch = cfg.plan.epoch
        self.restarts = 0
        self.load_failures = 0
        self.held = False
        self.released = False
        self.message = "starting"
        self.exit_code: int | None = None
        self.done = threading.Event()

    # -- public API ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.exit_code is None

    def snapshot(self) -> Snapshot:
        with self._lock:
            ranks = [replace(r, stats=dict(r.stats) if r.stats else None) for r in self.ranks]
            return Snapshot(
                ranks=ranks, epoch=self.epoch, restarts=self.restarts, held=self.held,
                released=self.released, ready=self._ready_locked(), alive=self.alive,
                message=self.message,
            )

    def ready(self) -> bool:
        with self._lock:
            return self._ready_locked()

    def release(self, reason: str = "") -> tuple[bool, str]:
        with self._lock:
            if self.released:
                return True, "already released"
            self.released = True
            self._next_launch = None
            self.message = f"released: {reason}" if reason else "released"
            log.info("releasing local ranks (%s)", reason or "no reason given")
            self._stop_child(State.RELEASED, "released on request")
        self._reap()
        return True, self.message

    def restart(self, epoch: int) -> tuple[bool, int, str]:
        with self._lock:
            if epoch < self.epoch:
                return False, self.epoch, f"stale epoch {epoch}: agent is at epoch {self.epoch}"
            if epoch == self.epoch and not (self.held or self.released):
                return True, self.epoch, f"already running epoch {epoch}"
            log.info("restart for epoch %d (was %d)", epoch, self.epoch)
            self._stop_child(State.PENDING, f"restarting for epoch {epoch}")
            self.epoch = epoch
            self.held = False
            self.released = False
            self.load_failures = 0
            self.restarts += 1
            self._next_launch = time.monotonic()
            self.message = f"restarting for epoch {epoch}"
        self._wake.set()
        return True, epoch, self.message

    def refresh_now(self) -> None:
        """Re-probe ready ranks at the next tick (their stats changed, e.g. after an update)."""
        with self._lock:
            self._last_refresh = 0.0
        self._wake.set()

    def stop(self) -> None:
        """Stop every rank, remove their sockets, and end the loop (SIGTERM path)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.policy.stop_grace + 10)
        with self._lock:
            self._stop_child(State.RELEASED, "agent shutting down")
        self._reap()

    # -- loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._tick()
                self._notify()
                self._wake.wait(self.policy.poll_interval)
                self._wake.clear()
        except Exception as exc:  # a bug here must not leave ranks running unsupervised
            log.exception("supervisor loop failed")
            self._fatal(EXIT_DAEMON, f"supervisor loop failed: {exc}")

    def _notify(self) -> None:
        """Tell listeners (gRPC health) as soon as readiness or liveness flips."""
        seen = (self.ready(), self.alive)
        if seen != self._last_seen:
            self._last_seen = seen
            if self.on_change is not None:
                self.on_change()

    def _tick(self) -> None:
        self._reap()
        now = time.monotonic()
        with self._lock:
            if self._child is None:
                if self._next_launch is not None and now >= self._next_launch:
                    self._launch()
                return
            code = self._child.poll()
            if code is not None:
                self._on_failure(f"daemon launcher exited with code {code}", all_ranks=True)
                return
            dead = self._dead_watches()
        for index in dead:
            with self._lock:
                self._on_failure(
                    f"rank {self.ranks[index].spec.global_rank} ({self.ranks[index].spec.role}) "
                    "exited: its watch connection closed", only=index)
            return
        stuck = self._unresponsive(now)
        if stuck is not None:
            index, why = stuck
            with self._lock:
                if self._child is not None:
                    self._on_failure(
                        f"rank {self.ranks[index].spec.global_rank} "
                        f"({self.ranks[index].spec.role}) does not answer: {why}", only=index)
            return
        self._probe(now)
        with self._lock:
            loading = any(r.state == State.LOADING for r in self.ranks)
            if (self._child is not None and loading
                    and now - self._launched_at > self.cfg.load_timeout_s):
                self._on_failure(f"load did not finish within {self.cfg.load_timeout_s:g}s",
                                 all_ranks=True)

    def _launch(self) -> None:
        argv = self.runtime.command()
        env = {k: v for k, v in {**os.environ, **self.runtime.environment()}.items()
               if v is not None}
        self._next_launch = None
        if shutil.which(argv[0], path=env.get("PATH")) is None:
            self._fatal(EXIT_RUNTIME, f"runtime binary not found: {argv[0]}")
            return
        try:
            self._check_ports()
            if self.on_launch is not None:
                self.on_launch()
            # No preexec_fn in this threaded process: the launcher is started through a shim
            # that asks for SIGTERM should the agent die without stopping it (lifetime.py).
            self._child = subprocess.Popen(exiting_with_parent(argv), env=env,
                                           start_new_session=True, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            self._fatal(EXIT_RUNTIME, f"runtime binary not found: {argv[0]}")
            return
        except (OSError, PortInUse) as exc:
            self._on_launch_error(str(exc))
            return
        self._launched_at = time.monotonic()
        self._healthy = False
        pid = self._child.pid
        log.info("launched %s runtime (pid %d, epoch %d): %s", self.runtime.name, pid,
                 self.epoch, " ".join(argv))
        self.message = "loading"
        for r in self.ranks:
            self._set(r, State.LOADING, "loading")
            r.pid, r.bytes, r.load_seconds, r.stats = pid, 0, None, None

    def _check_ports(self) -> None:
        for name, port in self.runtime.local_ports():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                # Like the child's own server: only a live listener counts, not TIME_WAIT.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError as exc:
                    raise PortInUse(f"{name} port {port} is in use: {exc.strerror}") from exc

    def _on_launch_error(self, why: str) -> None:
        log.error("cannot launch the %s runtime: %s", self.runtime.name, why)
        for r in self.ranks:
            self._set(r, State.FAILED, why)
        self._after_failure(why)

    def _probe(self, now: float) -> None:
        with self._lock:
            if self._child is None:
                return
            refresh = now - self._last_refresh >= self.policy.refresh_interval
            todo = [(i, r.spec) for i, r in enumerate(self.ranks)
                    if r.state == State.LOADING or (refresh and r.state == State.READY)]
            url = self.runtime.health_url()
            check_health = bool(todo) or not self._healthy
            loading = any(self.ranks[i].state == State.LOADING for i, _ in todo)
        if refresh:
            self._last_refresh = now
        if not check_health:
            return
        healthy = http_health(url, self.policy.probe_timeout) if url else True
        results = [(i, spec, self.runtime.probe(spec, self.policy.probe_timeout))
                   for i, spec in todo]
        # Bytes loaded so far, so that Status shows a long load moving (runtime-reported).
        progress = self.runtime.loading_bytes(self.policy.probe_timeout) if loading else {}
        with self._lock:
            if self._child is None:
                return
            self._healthy = healthy
            for i, spec, probe in results:
                r = self.ranks[i]
                if r.state == State.LOADING and probe.ok:
                    r.bytes, r.stats = probe.bytes, probe.stats
                    r.load_seconds = time.monotonic() - self._launched_at
                    self._set(r, State.READY, "")
                    log.info("rank %d (%s) on %s ready: %d bytes in %.2fs", spec.global_rank,
                             spec.role, spec.device.uuid, probe.bytes, r.load_seconds)
                    self._open_watch(i, spec)
                elif r.state == State.READY and probe.ok:
                    r.bytes, r.stats = probe.bytes, probe.stats
                elif r.state == State.LOADING:
                    r.message = f"loading ({probe.error})"
                    if spec.global_rank in progress:
                        r.bytes = progress[spec.global_rank]
            if self._all_ready_locked() and self.message != "ready":
                self.message = "ready"
                self.load_failures = 0
                log.info("all %d local rank(s) ready (epoch %d)", len(self.ranks), self.epoch)

    def _unresponsive(self, now: float) -> tuple[int, str] | None:
        """Ping ready ranks (outside the state lock); the first that missed too many pings."""
        alive = getattr(self.runtime, "liveness", None)
        if alive is None or now - self._last_liveness < self.policy.liveness_interval:
            return None
        self._last_liveness = now
        with self._lock:
            todo = [(i, r.spec) for i, r in enumerate(self.ranks) if r.state == State.READY]
        for i, spec in todo:
            why = alive(spec, self.policy.liveness_timeout)
            if why is None:
                self._missed.pop(i, None)
                continue
            self._missed[i] = self._missed.get(i, 0) + 1
            if self._missed[i] >= self.policy.liveness_failures:
                self._missed.pop(i, None)
                return i, why
        return None

    def _open_watch(self, index: int, spec: RankSpec) -> None:
        try:
            sock = self.runtime.watch(spec, self.policy.probe_timeout)
        except Exception as exc:  # watch is best effort; the launcher exit is still caught
            log.warning("cannot watch rank %d: %s", spec.global_rank, exc)
            return
        if sock is not None:
            old = self._watches.pop(index, None)
            if old is not None:
                old.close()
            self._watches[index] = sock

    def _dead_watches(self) -> list[int]:
        if not self._watches:
            return []
        socks = list(self._watches.items())
        readable, _, _ = select.select([s for _, s in socks], [], [], 0)
        dead = []
        for index, sock in socks:
            if sock in readable:
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    dead.append(index)
        return dead

    def _close_watches(self) -> None:
        for sock in self._watches.values():
            with contextlib.suppress(OSError):
                sock.close()
        self._watches.clear()

    # -- failures -----------------------------------------------------------------------------
    def _on_failure(self, why: str, *, all_ranks: bool = False, only: int | None = None) -> None:
        was_ready = self._all_ready_locked()
        log.error("%s (epoch %d)", why, self.epoch)
        for i, r in enumerate(self.ranks):
            if all_ranks or i == only:
                self._set(r, State.FAILED, why)
        if self.cfg.multi_node and only is not None and self._child is not None:
            # The other local ranks still serve valid shards: keep them until the new epoch.
            watch = self._watches.pop(only, None)
            if watch is not None:
                watch.close()
            self.held = True
            self.message = f"held for a new epoch: {why}"
            return
        self._stop_child(None, why)
        if was_ready:
            self.load_failures = 0
        self._after_failure(why)

    def _after_failure(self, why: str) -> None:
        if self.cfg.multi_node:
            self.held = True
            self.message = f"held for a new epoch: {why}"
            log.error("multi-node group: not restarting alone; waiting for the operator to "
                      "bump the epoch past %d", self.epoch)
            return
        self.load_failures += 1
        if self.load_failures >= self.policy.max_load_failures:
            self._fatal(EXIT_DAEMON, f"daemons failed {self.load_failures} times in a row "
                        f"without becoming ready; last: {why}")
            return
        delay = min(self.policy.backoff_initial * 2 ** (self.load_failures - 1),
                    self.policy.backoff_max)
        self.restarts += 1
        self._next_launch = time.monotonic() + delay
        self.message = f"restarting in {delay:g}s: {why}"
        log.warning("restarting the daemons in %.1fs (restart %d)", delay, self.restarts)
        for r in self.ranks:
            if r.state != State.FAILED:
                self._set(r, State.PENDING, "waiting for restart")

    def _fatal(self, code: int, why: str) -> None:
        log.error("fatal: %s", why)
        with self._lock:
            self.message = why
            self.exit_code = code
            for r in self.ranks:
                if r.state != State.FAILED:
                    self._set(r, State.FAILED, why)
            self._stop_child(None, why)
        self._stopping.set()
        self.done.set()
        if self.on_fatal is not None:
            self.on_fatal(code, why)

    # -- helpers ------------------------------------------------------------------------------
    def _set(self, r: RankStatus, state: State, message: str) -> None:
        if r.state != state:
            r.since = time.time()
        r.state, r.message = state, message

    def _ready_locked(self) -> bool:
        return (self._child is not None and self._healthy and not self.held
                and self._all_ready_locked())

    def _all_ready_locked(self) -> bool:
        return bool(self.ranks) and all(r.state == State.READY for r in self.ranks)

    def _stop_child(self, state: State | None, why: str) -> None:
        """Detach the launcher for `_reap` to stop; the caller holds the state lock."""
        self._close_watches()
        child, self._child = self._child, None
        self._healthy = False
        if child is not None:
            self._reaping.append(child)
            self._stop_reason = why
        for r in self.ranks:
            r.pid = 0
            r.bytes = 0
            if state is not None:
                self._set(r, state, why)

    def _reap(self) -> None:
        """Terminate detached launchers' process groups and clean their sockets."""
        with self._reap_lock:
            while True:
                with self._lock:
                    if not self._reaping:
                        return
                    child = self._reaping.pop(0)
                    why = self._stop_reason
                _terminate_group(child, self.policy.stop_grace)
                log.info("daemon launcher (pid %d) stopped: %s", child.pid, why)
                self._clean_sockets()

    def _clean_sockets(self) -> None:
        """Remove our ranks' sockets and lock files left by a killed daemon."""
        uid = os.getuid()
        for r in self.ranks:
            for path in (r.spec.socket_path, r.spec.socket_path + ".lock"):
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                if info.st_uid == uid and not stat.S_ISDIR(info.st_mode):
                    with contextlib.suppress(OSError):
                        os.unlink(path)


class PortInUse(ProjectError):
    """A port the child must bind is already taken."""


def _terminate_group(child: subprocess.Popen[bytes], grace: float) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGTERM)
        os.killpg(child.pid, signal.SIGCONT)  # a stopped rank must run to handle SIGTERM
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log.warning("launcher pid %d ignored SIGTERM for %.0fs; killing", child.pid, grace)
    # Ranks that outlived the launcher are still in its process group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)
