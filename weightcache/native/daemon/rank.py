"""One daemon rank: load this rank's shard into one arena, then serve it on a Unix socket.

Started by `weightcache preload` (one process per rank) as
`python -m weightcache.native.daemon ...`. Order matters: take the socket's lock, remove a stale
socket, load the whole shard, and only then bind, so a client either finds no socket (and
falls back) or a daemon with a complete table. The launcher learns that the rank serves from
one `SERVING {json}` line on stdout.

Exit codes: 0 clean stop, 2 bad input (model, shard rules, flags), 3 another daemon holds the
socket, 4 socket directory refused by the security checks, 1 anything else.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.contracts.vocabulary import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_SECURITY,
)

from ..shared import diskshare, headstart, importset, limits, loadenv, tpshare
from ..shared.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from ..shared.earlyread import EarlyReads, default_budget
from ..shared.identity import device_identity, socket_path
from ..shared.security import (
    AlreadyRunningError,
    SecurityError,
    SocketLock,
    bind_unix_socket,
    check_socket_slot,
    prepare_socket_dir,
)
from ..shared.sharding import ShardingError, ShardRule, parse_rules
from .config import BIND_DELAY_ENV, RankConfig, RankRefused, build_parser
from .lifetime import request_parent_death_signal
from .progress import PhaseClock, emit

if TYPE_CHECKING:  # torch is imported only once this rank holds its socket's lock
    from .loading import LoadedShard
    from .server import RankServer

__all__ = ["BIND_DELAY_ENV", "build_parser", "main", "run"]

log = logging.getLogger("weightcache.daemon")


def import_for_fill(cuda: bool = True) -> tuple[Any, Any]:
    """What a rank imports once it holds its lock, before its fill: torch with the fill and
    the server, and the arena's transports, with `cuda` (a rank on a CUDA device; the seed,
    which serves every node) the driver bindings too (`transport.load_all`). One list for the
    rank and for the agent image's seed (`seedset`), so that the seed names what a start
    reads. (loading, server)."""
    from ..shared import transport
    from . import loading, server

    transport.load_all(cuda)
    return loading, server


class Stop(BaseException):
    """Raised by the signal handler while a rank loads, to abandon the load.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (logging's
    own error handling among them) can swallow it. Once the rank serves, the handler no longer
    raises: it sets the server's stop flag and wakes the accept loop instead (`_Serving`).
    """


class _Serving:
    """The server and listener of this process once it serves, for the signal handler.

    `abandon` is true while a signal may abandon the load by raising `Stop`; the handler
    clears it before raising, so a second signal (the launcher's SIGTERM after a Ctrl-C that
    reached the whole process group) can never raise again inside the cleanup. While the
    socket's lock is being taken (`claim_socket`) nothing owns it yet to release it, so a stop
    signal then is only noted (`pending`) and raised once `_Held` holds the lock: a `Stop`
    raised in between left the lock file behind.

    Every stop signal before serving is noted in `pending`, also the one that raises, and
    `run` looks at it between its steps (`_stop_if_asked`): a `Stop` raised where some code
    swallows it (a bare `except:` among the libraries a rank imports, say) still stops the rank
    at its next step. Without that look, the handler had cleared `abandon`, so every later
    signal was only noted. (Once, in a clean clone's tests, a rank sent SIGTERM while it
    loaded ran on until the launcher killed it 15 s later, and its lock file stayed behind,
    with nothing on its stderr. Whether its `Stop` was swallowed was not found out: 104 runs of
    that test's two loading cases and 40 SIGTERMs at random moments of a rank's start did not
    repeat it.)
    """

    server: RankServer | None = None
    listener: socket.socket | None = None
    abandon: bool = True
    pending: bool = False


@dataclass
class _Held:
    """What this rank holds and must give back on the way out, whatever stopped it."""

    path: Path
    lock: SocketLock
    early: EarlyReads | None = None
    prefetch: importset.Prefetch | None = None
    shard: LoadedShard | None = None
    server: RankServer | None = None
    listener: socket.socket | None = None

    def release(self) -> None:
        # From here on signals must not interrupt: the cleanup is what they ask for.
        _Serving.abandon = False
        _ignore_stop_signals()
        if self.prefetch is not None:
            self.prefetch.stop()
        if self.early is not None:
            self.early.close()
        _Serving.server = _Serving.listener = None
        if self.server is not None:
            self.server.shutdown()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self.shard is not None:
            self.shard.arena.close()
        self.lock.release()


def run(config: RankConfig,
        prefetch: tuple[Path | None, importset.Prefetch | None] | None = None,
        exec_at: float | None = None) -> int:
    """Check input, take the lock, then (and only then) import torch, load, bind, serve.

    Taking the lock before importing torch makes a second daemon for the same device fail
    in a fraction of a second. `prefetch`: the import set's read-ahead, if the process
    started it before importing this module (`__main__`); else it starts here. `exec_at`:
    when `__main__` began (READY's `marks`).
    """
    clock = PhaseClock()
    if exec_at is not None:
        clock.stamp("exec", exec_at)
    clock.stamp("run")
    if config.parent_pid is not None:  # the launcher: its faults and reads (its head start,
        diskshare.count_as_own(config.parent_pid, reads=True)  # headstart.py) are this start's
    _Serving.abandon = False  # a stop signal from here waits until `held` owns the lock
    try:
        ckpt, rules = read_input(config)
        clock.stamp("input")
        held = claim_socket(config)
        clock.stamp("locked")
    except RankRefused as exc:
        log.error("%s", exc)
        if prefetch is not None and prefetch[1] is not None:
            prefetch[1].stop()
        return exc.code
    try:
        _Serving.abandon = True
        if _Serving.pending:  # the signal that came while the lock was taken
            _Serving.abandon = False
            raise Stop()
        # What the last start read: read it ahead, in large reads.
        set_file, held.prefetch = prefetch or importset.start_prefetch()
        if held.prefetch is not None and held.prefetch.child is not None:
            diskshare.count_as_own(held.prefetch.child, reads=True)  # this start's reads
        held.early = start_early_reads(config, ckpt, held.prefetch, rules)
        clock.stamp("early_started")
        if held.prefetch is not None:
            held.prefetch.wait_for_import(PREFETCH_WAIT_S)
        # torch: only now that this rank holds its lock
        loading, server = import_for_fill(config.device == "cuda")
        clock.stamp("imported")
        _stop_if_asked()
        held.shard = loading.load(config, ckpt, rules, held.path, clock, held.early)
        reap_when_done(held.prefetch)  # the load's shares have stopped
        _stop_if_asked()
        held.server = server.serve_shard(held.shard, config, rules, ckpt)
        held.listener = bind(config, held.path)
        _stop_if_asked()
        announce(config, held.shard, held.path, clock, held.prefetch)
        if set_file is not None and (held.prefetch is None or held.prefetch.needs_record()):
            # For the next start, off the critical path.
            threading.Thread(target=importset.record,
                             args=(set_file, [*ckpt.files, held.path]),
                             name="weightcache-import-set", daemon=True).start()
        else:
            importset.stop_watching()
        _Serving.server, _Serving.listener = held.server, held.listener
        held.server.serve(held.listener)
        return EXIT_OK
    except RankRefused as exc:
        log.error("%s", exc)
        return exc.code
    except Stop:
        return EXIT_OK
    except Exception as exc:  # report any failure as this rank's exit code, never hang
        log.error("rank %d failed: %s: %s", config.tp_rank, type(exc).__name__, exc)
        return EXIT_ERROR
    finally:
        held.release()


def reap_when_done(prefetch: importset.Prefetch | None) -> None:
    """The process that read the import set (importset.Prefetch._fork), reaped once the set
    is read, and no longer counted as this start's by shares made later (its pid may be
    reused). Called once the load's disk shares have stopped (diskshare.DiskShare._own_reads)."""
    if prefetch is None or prefetch.child is None:
        return
    pid = prefetch.child

    def reap() -> None:
        prefetch.close()
        diskshare.forget_own(pid)

    prefetch.when_done(reap)


def read_input(config: RankConfig) -> tuple[Checkpoint, list[ShardRule]]:
    """The checkpoint's headers, the shard rules and the load's knobs (exit 2 if any is bad;
    the fill itself takes a bad knob as its default, loadenv.py)."""
    try:
        loadenv.check()
    except ValueError as exc:
        raise RankRefused(str(exc)) from None
    try:
        return open_checkpoint(config.model), parse_rules(config.shard_rules)
    except (CheckpointError, ShardingError) as exc:
        raise RankRefused(str(exc)) from None


def claim_socket(config: RankConfig) -> _Held:
    """The socket directory checked, this device's lock taken and its socket path free."""
    try:
        sock_dir = prepare_socket_dir(config.socket_dir)
    except (SecurityError, OSError) as exc:
        raise RankRefused(f"socket directory refused: {exc}", EXIT_SECURITY) from None
    # The launcher's UUID where it gave one (no cuInit of our own in front of the early
    # reads); checked against the device once its context exists (loading.open_device).
    identity = config.device_uuid or device_identity(config.device, config.device_index)
    path = socket_path(sock_dir, identity, config.role)
    lock = SocketLock(path)
    try:
        lock.acquire()
    except AlreadyRunningError as exc:
        raise RankRefused(str(exc), EXIT_LOCKED) from None
    except SecurityError as exc:
        raise RankRefused(f"cannot lock {lock.path}: {exc}", EXIT_SECURITY) from None
    except OSError as exc:  # ENOSPC, EIO...: not a security verdict
        raise RankRefused(f"cannot lock {lock.path}: {exc}", EXIT_ERROR) from None
    try:
        check_socket_slot(path)
    except (SecurityError, OSError) as exc:
        lock.release()
        raise RankRefused(str(exc), EXIT_SECURITY) from None
    return _Held(Path(path), lock)


def start_early_reads(config: RankConfig, ckpt: Checkpoint,
                      prefetch: importset.Prefetch | None = None,
                      rules: list[ShardRule] | None = None) -> EarlyReads | None:
    """Read the rank's first jobs while torch and the device start (earlyread.py; the fill
    digests them). Nothing when the budget is 0.

    A whole-file rank (tensor-parallel size 1) reads its files front to back. A
    tensor-parallel rank reads the jobs of its share that no other rank of its group reads
    (tpshare.py: from the headers, the shard rules and `--dtype`, without torch; planned on
    the early reads' own thread); the chunks the ranks share are left to their fills' buffered
    reads, which the page cache lets them share.
    """
    try:
        budget = default_budget(config.local_ranks)
    except ValueError as exc:
        raise RankRefused(str(exc)) from None
    if budget <= 0:
        return None
    # The early reads go gentle while the import faults (diskshare.py); the fill too. Once
    # the import set is in the page cache whole, the faults that came before it are of pages
    # now in memory, and the libraries the import still needs are there: full reads at once
    # (on the H200, READY with the share off was 0.7-0.8 s sooner than gentle for 1.5 s and
    # more: run14; with half a second gentle first, `import torch` was faster but READY the
    # same or 0.45-0.6 s later: runs 49-50). A set found in memory but for a small part (a
    # restart: importset.Prefetch._census) lets them start at once; a fault of the import's
    # on a missing page makes them gentle again. With no import set (or an empty one: a
    # node's first start), nothing says the libraries are in memory: the start's half second
    # stays gentle.
    span = 0.0 if prefetch is not None and prefetch.files else diskshare.START_GENTLE
    disk, _ = diskshare.for_load(start_gentle=loadenv.start_gentle(span), own=True)
    after = prefetch.early_go if prefetch is not None else None  # after the import set
    if disk is not None and prefetch is not None:
        share = disk
        if not importset.early_reads_wait():  # beside it, gentle until it is read
            share.hold_gentle()
            after = None
        prefetch.when_warm(share.settle)
        prefetch.when_done(lambda: share.settle() if prefetch.whole() else share.let_go())
    plan, ahead = None, None
    if config.tp_size == 1 and config.head_start_bytes:  # the launcher's asks: the fill's
        ahead = headstart.extents(ckpt.files, config.head_start_bytes)
    if config.tp_size > 1:
        plan = functools.partial(tpshare.own_chunks, ckpt, rules if rules is not None else
                                 parse_rules(config.shard_rules), config.tp_size,
                                 config.tp_rank, config.dtype)
    return EarlyReads(ckpt.files, budget, disk=disk, plan=plan, ahead=ahead).start(
        after, PREFETCH_WAIT_S)


PREFETCH_WAIT_S = 3.0  # the early reads wait at most this long for the import set


def bind(config: RankConfig, path: Path) -> socket.socket:
    """Only now, with the whole shard loaded, does the socket appear."""
    try:
        return bind_unix_socket(path, limits.LISTEN_BACKLOG, shared=bool(config.allowed_uids))
    except SecurityError as exc:
        raise RankRefused(str(exc), EXIT_SECURITY) from None


def announce(config: RankConfig, shard: LoadedShard, path: Path, clock: PhaseClock,
             prefetch: importset.Prefetch | None = None) -> None:
    """The `SERVING {json}` line the launcher waits for."""
    layout, seconds = shard.layout, shard.load_seconds
    clock.stamp("serving")
    emit("SERVING " + json.dumps({
        "rank": config.tp_rank,
        "global_rank": config.global_rank,
        "dp_rank": config.dp_rank,
        "local_rank": config.device_index,
        "socket": str(path),
        "device": device_identity(config.device, config.device_index),
        "bytes": layout.nbytes,
        "tensors": len(layout.entries),
        "load_seconds": round(seconds, 4),
        "load_gb_per_s": float(f"{layout.nbytes / seconds / 1e9:.4g}") if seconds > 0 else None,
        "phases": clock.phases,
        "marks": clock.marks,
        "early": shard.early,
        "import_prefetch": prefetch.stats() if prefetch is not None else None,
        "loader": shard.loader.as_dict() if shard.loader is not None else None,
        "pid": os.getpid(),
        "content": shard.fingerprint["content"],
    }))
    log.info("rank %d serving %d bytes on %s", config.tp_rank, layout.nbytes, path)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _on_signal(signum: int, frame: Any) -> None:
    server, listener = _Serving.server, _Serving.listener
    if server is None or listener is None:
        _Serving.pending = True  # `run` looks at it between its steps, whatever happens below
        if _Serving.abandon:
            _Serving.abandon = False
            raise Stop()
        return  # taking the lock, or cleaning up: `run` sees `pending`
    server.stopping.set()
    # accept() is retried after the handler returns (PEP 475); a shut-down listener makes it
    # fail at once, and serve() sees the stop flag.
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)


def _stop_if_asked() -> None:
    """Between two of `run`'s steps: a stop signal came, and its `Stop` never reached `run`
    (swallowed on the way, or only noted: `_Serving`)."""
    if _Serving.pending:
        _Serving.abandon = False
        log.warning("a stop signal's Stop was lost on the way; stopping now")
        raise Stop()


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when the launcher dies, so ranks never outlive it."""
    if parent_pid is not None and not request_parent_death_signal(parent_pid):
        raise Stop()


def main(argv: list[str] | None = None,
         prefetch: tuple[Path | None, importset.Prefetch | None] | None = None,
         exec_at: float | None = None) -> int:
    """The rank's process; `prefetch` and `exec_at` as `run` takes them."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{args.rank if args.global_rank is None else args.global_rank}"
        " %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        config = RankConfig.from_args(args)
    except RankRefused as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    try:
        _die_with_parent(config.parent_pid)
        return run(config, prefetch, exec_at)
    except Stop:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
