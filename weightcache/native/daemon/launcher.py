"""`weightcache preload`: the native weight cache daemon, one process per rank.

Flags follow `vllm preload` where the meaning is the same, including the multi-node and
data-parallel ones (`--nnodes`, `--node-rank`, `--data-parallel-size`,
`--data-parallel-size-local`, `--data-parallel-start-rank`): local device i serves the global
rank vLLM's engine gives it (weightcache.contracts.layout). Native ranks need no rendezvous, so
there is no master address or port. The launcher checks the layout, the model and the shard
rules for every rank before starting anything (so bad input fails once, clearly), starts one
`weightcache.native.daemon` process per local rank (fresh interpreters, never fork, so
CUDA and torch threads are safe), prints one `READY {json}` line when every rank serves, and
exits with the failing rank's exit code if a rank dies. SIGINT/SIGTERM stop every rank (which
unlinks its socket and lock file and frees its arena). With --weight-cache-health-port, GET
/health answers 200 while all ranks serve and 503 otherwise.

Stdout carries only machine-readable lines: `HEALTH {json}` (when enabled) and `READY {json}`
(bytes, seconds to serving, GB/s, and each rank's own load time). While ranks load, progress
(bytes, GB/s, ETA) goes to stderr: a bar on a terminal, a plain line every few seconds
otherwise (`WEIGHTCACHE_PROGRESS_INTERVAL_S`); /health shows the bytes loaded so far.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from weightcache.cliformat import HelpFormatter
from weightcache.contracts.layout import Layout, LocalRank, RankLayoutError
from weightcache.contracts.vocabulary import EXIT_BAD_INPUT, EXIT_SECURITY
from weightcache.errors import ProjectError

from ..shared.checkpoint import CheckpointError, open_checkpoint, tied_aliases
from ..shared.errors import WeightCacheError
from ..shared.flags import add_allow_uid_flag, add_shard_flags, shard_argv, shard_rules
from ..shared.gpu import visible_device_uuids
from ..shared.headstart import HeadStart
from ..shared.security import SecurityError, prepare_socket_dir
from ..shared.sharding import ShardingError, parse_rules, plan_shard
from .lifetime import python_module, request_parent_death_signal
from .progress import ProgressPrinter

if TYPE_CHECKING:  # imported by _health_server: 25 ms (ssl, email) a start without it skips
    from http.server import ThreadingHTTPServer
    from pathlib import Path

log = logging.getLogger("weightcache.preload")

STOP_GRACE_S = 15.0
# Liveness: a serving rank that does not answer `hello` within LIVENESS_TIMEOUT_S, twice in
# a row, is reported `unresponsive` (503): a stopped or hung process still has its socket, so
# only an answer proves it serves.
LIVENESS_INTERVAL_S = 1.0
LIVENESS_TIMEOUT_S = 1.0
LIVENESS_FAILURES = 2


class Rank:
    def __init__(self, place: LocalRank, proc: subprocess.Popen, wake: threading.Event) -> None:
        self.place = place
        self.wake = wake  # the launcher's: set when this rank serves or its output ends
        self.rank = place.global_rank
        self.proc = proc
        self.info: dict[str, Any] | None = None
        self.serving = threading.Event()
        self.missed = 0  # consecutive unanswered liveness pings
        self.loading: dict[str, Any] = {}  # the rank's last LOADING line

    def loaded(self) -> tuple[int, int]:
        """(bytes in the arena so far, bytes of the shard; 0 before the rank knows)."""
        if self.info:
            total = int(self.info.get("bytes") or 0)
            return total, total
        return int(self.loading.get("bytes_loaded") or 0), int(self.loading.get("bytes") or 0)

    def state(self) -> dict[str, Any]:
        code = self.proc.poll()
        status = "exited" if code is not None else "serving" if self.serving.is_set() else "loading"
        if status == "serving" and self.missed >= LIVENESS_FAILURES:
            status = "unresponsive"
        out: dict[str, Any] = {"rank": self.rank, "local_rank": self.place.local,
                               "tp_rank": self.place.tp_rank, "dp_rank": self.place.dp_rank,
                               "state": status, "pid": self.proc.pid}
        done, total = self.loaded()
        out.update(bytes_loaded=done, bytes=total)
        if self.info:
            out.update(socket=self.info.get("socket"), load_seconds=self.info.get("load_seconds"))
        if code is not None:
            out["exit_code"] = code
        return out


def _reader(rank: Rank) -> None:
    assert rank.proc.stdout is not None
    for line in rank.proc.stdout:
        if line.startswith("SERVING "):
            try:
                rank.info = json.loads(line[len("SERVING ") :])
            except ValueError:
                rank.info = {}
            rank.serving.set()
            rank.wake.set()  # READY without the main loop's poll interval in front
        elif line.startswith("LOADING "):
            with contextlib.suppress(ValueError):
                rank.loading = json.loads(line[len("LOADING ") :])
        else:
            sys.stderr.write(f"[rank {rank.rank}] {line}")
    rank.wake.set()  # its stdout closed: it is exiting


def _answers(path: str, timeout: float) -> bool:
    """Does the rank answer a `hello` on its socket within `timeout`? (Any reply counts:
    even `busy` proves the process runs.) Asked through the checked connect: only a process
    of our uid at the rank's path counts, so a stranger's listener swapped in behind the path
    cannot answer for a stopped rank."""
    # Here, not at the top: the connection and its protocol (msgpack) were 19 ms of
    # imports (python -X importtime), and nothing asks a rank before it serves.
    from ..shared.connection import query

    try:
        query(path, "hello", timeout=timeout)
        return True
    except WeightCacheError:
        return False


def _liveness(ranks: list[Rank], stop: threading.Event) -> None:
    while not stop.wait(LIVENESS_INTERVAL_S):
        for r in list(ranks):
            path = (r.info or {}).get("socket")
            if not r.serving.is_set() or not path or r.proc.poll() is not None:
                continue
            if _answers(path, LIVENESS_TIMEOUT_S):
                if r.missed >= LIVENESS_FAILURES:
                    log.warning("rank %d answers again", r.rank)
                r.missed = 0
            else:
                r.missed += 1
                if r.missed == LIVENESS_FAILURES:
                    log.error("rank %d (pid %d) does not answer on %s: unresponsive",
                              r.rank, r.proc.pid, path)


def _health_server(host: str, port: int, ranks: list[Rank]) -> ThreadingHTTPServer:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/health", "/healthz"):
                self.send_error(404)
                return
            states = [r.state() for r in ranks]
            ready = bool(states) and all(s["state"] == "serving" for s in states)
            # An unresponsive rank makes the whole launcher not ready (`state` says which).
            body = json.dumps({
                "ready": ready, "ranks": states,
                "bytes_loaded": sum(s["bytes_loaded"] for s in states),
                "bytes": sum(s["bytes"] for s in states),
            }).encode()
            self.send_response(200 if ready else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache preload", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    add_shard_flags(
        p, model_help="local directory of .safetensors files (and config.json); a hub id must "
                      "be downloaded first",
        tp_help=None,  # with the other parallel flags: Layout.add_arguments
        dtype_help="dtype the tensors are cached in (auto: as stored); engines must ask for the "
                   "same one",
        rules_help="split tensors matching REGEX along DIM (repeatable; default: Llama)")
    Layout.add_arguments(p)
    p.add_argument("--weight-cache-socket-dir", "--socket-dir", dest="weight_cache_socket_dir",
                   default=None,
                   help="socket directory (default: a private per-user dir under the temp dir)")
    p.add_argument("--weight-cache-health-port", type=int, default=None,
                   help="serve GET /health on this port (0: any free port)")
    p.add_argument("--weight-cache-health-host", default="127.0.0.1",
                   help="address the /health endpoint listens on")
    add_allow_uid_flag(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arenas live: cuda needs one visible GPU per local rank")
    p.add_argument("--transport", default=None,
                   help="arena transport: memfd (cpu), cuda_vmm or cuda_ipc (cuda); "
                        "None picks the best available")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop all ranks when the process that started us dies (for supervisors)")
    return p


class _Devices:
    """The devices this launcher may place ranks on, asked on a thread from its first moment.

    On CUDA that is the driver's start (`cuInit`), which overlaps reading the checkpoint's
    headers instead of adding to them; each rank is then handed its device's UUID
    (`--device-uuid`) and starts its early reads without a `cuInit` of its own in front
    (gpu.visible_device_uuids). Torch-free: the ranks import torch themselves.
    """

    def __init__(self, kind: str) -> None:
        self.uuids: list[str] | None = None
        self._count = 0
        self._thread: threading.Thread | None = None
        if kind == "cuda":
            self._thread = threading.Thread(target=self._ask, name="devices", daemon=True)
            self._thread.start()
        else:
            self._count = os.cpu_count() or 1

    def _ask(self) -> None:
        self.uuids = visible_device_uuids()
        if self.uuids is None:  # no cuda-python or no driver: torch's count, as before
            import torch

            self._count = torch.cuda.device_count()
        else:
            self._count = len(self.uuids)

    def count(self) -> int:
        if self._thread is not None:
            self._thread.join()
        return self._count

    def uuid(self, index: int) -> str | None:
        """Device `index`'s UUID (None on CPU, or where the driver could not be asked)."""
        self.count()
        return self.uuids[index] if self.uuids is not None and index < len(self.uuids) else None


class PreloadRefused(ProjectError):
    """Input that would make a rank fail, found before any rank starts; `code` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


def _validate(args: argparse.Namespace, found: _Devices
              ) -> tuple[list[LocalRank], list[Path]]:
    """Everything that would make a rank fail on input, checked once for all ranks; the ranks
    this launcher serves and the checkpoint's files, or PreloadRefused.

    Only headers are read and torch is not imported, so bad input fails in well under a
    second instead of after every rank has started.
    """
    tp = args.tensor_parallel_size
    layout = Layout.from_args(args)
    try:
        placements = layout.local_ranks()
    except RankLayoutError as exc:
        raise PreloadRefused(str(exc)) from None
    try:
        files = _check_model(args, tp)  # while the driver starts on the devices' thread
    except PreloadRefused:  # a device shortfall is reported before a bad header, as before
        _check_devices(args, layout, len(placements), found)
        raise
    _check_devices(args, layout, len(placements), found)
    try:
        prepare_socket_dir(args.weight_cache_socket_dir)
    except (SecurityError, OSError) as exc:
        raise PreloadRefused(f"socket directory refused: {exc}", EXIT_SECURITY) from None
    return placements, files


def _check_devices(args: argparse.Namespace, layout: Layout, local: int, found: _Devices
                   ) -> None:
    """This node has a device for each of its `local` ranks (PreloadRefused if not)."""
    tp = args.tensor_parallel_size
    devices = found.count()
    if args.device == "cuda" and devices == 0:
        raise PreloadRefused(
            "--device cuda: no CUDA device is visible here (torch.cuda.device_count() is 0);"
            " use --device cpu, or check the NVIDIA driver and CUDA_VISIBLE_DEVICES")
    if local > devices and local == tp:
        raise PreloadRefused(
            f"--tensor-parallel-size {tp} exceeds the {devices} {args.device} device(s) here")
    if local > devices:
        raise PreloadRefused(f"{layout.describe()}: this node would serve {local} local ranks, "
                             f"more than the {devices} {args.device} device(s) here")


def _check_model(args: argparse.Namespace, tp: int) -> list[Path]:
    """Every header and the shard rules' divisibility; warn when no rule splits anything.
    The checkpoint's files."""
    try:
        rules = parse_rules(shard_rules(args))
        ckpt = open_checkpoint(args.model)
        aliases = tied_aliases(ckpt)
        split = 0
        for name, info in ckpt.tensors.items():
            if name not in aliases:
                split += plan_shard(name, info.shape, rules, tp, 0).dim is not None
    except (CheckpointError, ShardingError) as exc:
        raise PreloadRefused(str(exc)) from None
    if tp > 1 and split == 0 and not args.no_shard_rules:
        log.warning(
            "no shard rule matches any of the %d tensor names of %s: every tensor is "
            "replicated, each of the %d ranks holds the whole model; give --shard-rule "
            "REGEX=DIM for this architecture (or --no-shard-rules to replicate on purpose)",
            len(ckpt.tensors), args.model, tp)
    return ckpt.files


# What READY carries of each rank's SERVING line (docs/native.md, "READY").
RANK_LOAD_FIELDS = ("load_gb_per_s", "phases", "loader", "early", "import_prefetch", "marks")


def _rank_cmd(args: argparse.Namespace, place: LocalRank, local_ranks: int = 1,
              device_uuid: str | None = None, head_start: int = 0) -> list[str]:
    cmd = [
        *python_module("weightcache.native.daemon"),
        *shard_argv(args.model, args.tensor_parallel_size, args.dtype, shard_rules(args)),
        "--rank", str(place.tp_rank),
        "--device-index", str(place.local),
        "--global-rank", str(place.global_rank),
        "--dp-rank", str(place.dp_rank),
        "--device", args.device,
        "--parent-pid", str(os.getpid()),
        "--local-ranks", str(local_ranks),
    ]
    if args.weight_cache_socket_dir:
        cmd += ["--weight-cache-socket-dir", args.weight_cache_socket_dir]
    for uid in args.allow_uid:
        cmd += ["--weight-cache-allow-uid", str(uid)]
    if args.transport:
        cmd += ["--transport", args.transport]
    if device_uuid is not None:
        cmd += ["--device-uuid", device_uuid]
    if head_start:
        cmd += ["--head-start-bytes", str(head_start)]
    return cmd


def _exit_with_parent(parent: int) -> None:
    """SIGTERM us when the parent dies, so a supervisor that is killed outright never leaves
    ranks holding the device's sockets and locks (`agent/lifetime.py`)."""
    if not request_parent_death_signal(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop_all(ranks: list[Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
            r.proc.send_signal(signal.SIGCONT)  # a stopped rank must run to handle SIGTERM
    deadline = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank %d did not stop in %.0f s; killing it", r.rank, STOP_GRACE_S)
            r.proc.kill()
            r.proc.wait()


def _progress_interval() -> float | None:
    value = os.environ.get("WEIGHTCACHE_PROGRESS_INTERVAL_S", "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        log.warning("WEIGHTCACHE_PROGRESS_INTERVAL_S=%r is not a number; using the default", value)
        return None


def _show_progress(printer: ProgressPrinter, ranks: list[Rank], started: float) -> None:
    """Sum the ranks' LOADING counts; print once the first rank has reported its size."""
    pairs = [r.loaded() for r in ranks]
    total = sum(t for _, t in pairs)
    # The rate counts from when the ranks started filling, not from the launcher's start.
    seconds = max((float(r.loading.get("seconds") or 0) for r in ranks), default=0.0)
    if total and printer.interval > 0:
        printer.update(sum(d for d, _ in pairs), total, seconds or time.monotonic() - started)


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    started = time.monotonic()  # READY's seconds count the checks too
    args = build_parser().parse_args(argv)
    found = _Devices(args.device)
    # The checkpoint's first bytes asked for before the ranks run, where the ranks' import set
    # is in memory: looked at beside the checks.
    head = HeadStart(whole_files=args.tensor_parallel_size == 1).judge()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s preload %(levelname)s %(message)s")
    try:
        placements, files = _validate(args, found)
    except KeyboardInterrupt:  # Ctrl-C before anything started: nothing to clean up
        return 130
    except PreloadRefused as exc:
        log.error("%s", exc)
        return exc.code

    stop = threading.Event()
    wake = threading.Event()  # the main loop looks again now (ranks, signals)
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        # Only this: an Event's lock is not reentrant, and a handler runs in the main thread
        # between any two bytecodes, perhaps inside that lock. The loop sees it within 0.05 s.
        received.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())

    ranks: list[Rank] = []
    health: ThreadingHTTPServer | None = None
    marks = {"main": started, "validated": time.monotonic()}
    asked = head.begin(files)
    try:
        if args.weight_cache_health_port is not None:
            try:
                health = _health_server(args.weight_cache_health_host,
                                        args.weight_cache_health_port, ranks)
            except OSError as exc:
                log.error("cannot serve /health on %s:%s: %s", args.weight_cache_health_host,
                          args.weight_cache_health_port, exc)
                return EXIT_BAD_INPUT
            host, port = health.server_address[:2]
            _emit("HEALTH " + json.dumps({"url": f"http://{host}:{port}/health"}))
        for place in placements:
            proc = subprocess.Popen(_rank_cmd(args, place, len(placements),
                                              found.uuid(place.local), asked),
                                    stdout=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL)
            r = Rank(place, proc, wake)
            ranks.append(r)
            threading.Thread(target=_reader, args=(r,), daemon=True).start()
        marks["spawned"] = time.monotonic()
        threading.Thread(target=_liveness, args=(ranks, stop), daemon=True,
                         name="liveness").start()
        announced = False
        printer = ProgressPrinter(sys.stderr, f"preload {os.path.basename(args.model.rstrip('/'))}",
                                  interval=_progress_interval())
        while not received:
            for r in ranks:
                code = r.proc.poll()
                if code is not None and received:
                    break  # a Ctrl-C reached the rank too (same process group): a clean stop
                if code is not None:
                    phase = "serving" if announced else "start-up"
                    log.error("rank %d exited with code %d during %s; stopping all ranks",
                              r.rank, code, phase)
                    _stop_all(ranks)
                    return _exit_code(code) or 1
            if not announced:
                _show_progress(printer, ranks, started)
            if not announced and all(r.serving.is_set() for r in ranks):
                announced = True
                infos = [r.info or {} for r in ranks]
                total = sum(int(i.get("bytes") or 0) for i in infos)
                elapsed = time.monotonic() - started
                printer.finish(total, elapsed)
                _emit("READY " + json.dumps({
                    "ranks": len(ranks),
                    "device": args.device,
                    "sockets": [i.get("socket") for i in infos],
                    "bytes": total,
                    "seconds": round(elapsed, 3),
                    "gb_per_s": float(f"{total / elapsed / 1e9:.4g}") if elapsed > 0 else None,
                    "load_seconds": [i.get("load_seconds") for i in infos],
                    "rank_loads": [{k: i.get(k) for k in RANK_LOAD_FIELDS} for i in infos],
                    "pids": [r.proc.pid for r in ranks],
                    "global_ranks": [r.place.global_rank for r in ranks],
                    "tp_ranks": [r.place.tp_rank for r in ranks],
                    "dp_ranks": [r.place.dp_rank for r in ranks],
                    "head_start": head.stats(),
                    "marks": {**marks, **head.marks},
                }))
            wake.wait(0.05)  # a rank's SERVING line or exit, or the next look
            wake.clear()
        stop.set()
        log.info("signal %s: stopping %d rank(s)", received[0] if received else "?", len(ranks))
        _stop_all(ranks)
        return 0
    finally:
        _stop_all(ranks)
        if health is not None:
            health.shutdown()
            health.server_close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
