"""The agent's half of GPU alignment: publish the GPU map, count what engines report.

The map (`gpu-map.json` in the socket directory, weightcache.contracts.alignment) says which
shard every local GPU holds, and `python/sitecustomize.py` (the source of that same module)
orders a vLLM engine's CUDA_VISIBLE_DEVICES by it before CUDA starts. Both are static for one
plan, so they are written once at start-up, atomically and read-only (0644; the directory
itself stays 0700, and engines run as the cache's uid).

Engines report each start's alignment to `alignment.sock` next to the daemons' sockets; the
agent is the only long-lived process on the node that both sees every engine of the cache and
exports Prometheus metrics, so the miss counter lives here. The listener accepts one bounded
JSON line per connection from our own uid only (SO_PEERCRED), with a deadline, and keeps
nothing per client but counters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from weightcache.agent.config import AgentConfig
from weightcache.agent.runtimes.base import RankSpec
from weightcache.contracts import alignment as al

log = logging.getLogger("weightcache.agent.alignment")
READ_TIMEOUT_S = 2.0
RECENT_MISSES = 32  # what gRPC Status carries for the operator's events


@dataclass(frozen=True)
class Miss:
    seq: int
    pod: str
    result: str
    detail: str
    missed_ranks: int


def holdings(cfg: AgentConfig, ranks: Sequence[RankSpec]) -> list[al.Holding]:
    tp = cfg.plan.layout.tensor
    per_replica = tp if tp <= cfg.local_world_size else cfg.local_world_size
    return [
        al.Holding(
            uuid=r.device.uuid, tp_rank=r.tp_rank, tp_size=tp, dp_rank=r.dp_rank,
            replica=r.local_index // per_replica, global_rank=r.global_rank,
            sockets={r.role: os.path.basename(r.socket_path)},
        )
        for r in ranks
    ]


def identity(cfg: AgentConfig) -> dict[str, object]:
    spec = cfg.spec
    return {
        "cache": cfg.plan.cache, "namespace": cfg.plan.namespace, "uid": cfg.plan.uid,
        "epoch": cfg.plan.epoch, "runtime": cfg.plan.runtime, "node": cfg.env.node,
        "nodeRank": cfg.node_rank, "model": spec.model.path,
        "tpSize": cfg.plan.layout.tensor, "expert": cfg.plan.layout.expert,
        "dtype": spec.engine_args.effective_dtype,
    }


def _write(path: str, text: str, mode: int) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def publish_map(cfg: AgentConfig, ranks: Sequence[RankSpec]) -> str:
    """Write `gpu-map.json` and `python/sitecustomize.py` (both 0644); return the map's path."""
    doc = al.build_map(identity(cfg), holdings(cfg, ranks))
    python_dir = os.path.join(cfg.socket_dir, al.PYTHON_DIR)
    os.makedirs(python_dir, mode=0o755, exist_ok=True)
    _write(os.path.join(python_dir, "sitecustomize.py"), al.sitecustomize_source(), 0o644)
    path = os.path.join(cfg.socket_dir, al.MAP_NAME)
    _write(path, json.dumps(doc, indent=1, sort_keys=True), 0o644)
    return path


class ReportServer:
    """Counts engines' alignment reports on `<socket_dir>/alignment.sock`."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cache = cfg.plan.cache
        self.where = [cfg.plan.cache, cfg.env.namespace, cfg.env.node]  # metrics.CACHE_LABELS
        self.path = os.path.join(cfg.socket_dir, al.REPORT_SOCKET)
        self.results = dict.fromkeys(al.RESULTS, 0)
        self.missed_ranks = 0
        self._recent: deque[Miss] = deque(maxlen=RECENT_MISSES)
        self._seq = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="alignment-reports", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _serve(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self.handle(conn)
                except (OSError, ValueError) as exc:
                    log.debug("alignment report refused: %s", exc)

    def handle(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise ValueError(f"report from uid {uid}, not {os.getuid()}")
        conn.settimeout(READ_TIMEOUT_S)
        data = b""
        while b"\n" not in data and len(data) < al.MAX_REPORT_BYTES:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        self.record(json.loads(data[: al.MAX_REPORT_BYTES].split(b"\n", 1)[0]))

    def record(self, doc: object) -> None:
        if not isinstance(doc, dict) or doc.get("result") not in al.RESULTS:
            raise ValueError("not an alignment report")
        ranks = doc.get("ranks") if isinstance(doc.get("ranks"), list) else []
        missed = [r for r in ranks if isinstance(r, dict) and r.get("hit") is False]
        pod = str(doc.get("pod"))[:253]
        detail = "; ".join(
            f"rank {r.get('local')} (tp_rank {r.get('tpRank')}) on {r.get('gpu')} holding "
            f"tp_rank {r.get('heldTpRank')}" for r in missed[:16]
        )
        with self._lock:
            self.results[doc["result"]] += 1
            self.missed_ranks += len(missed)
            if missed:
                self._seq += 1
                self._recent.append(Miss(self._seq, pod, doc["result"], detail[:900], len(missed)))
        if missed:
            log.warning("engine %s started %s: %d rank(s) load from disk: %s",
                        pod, doc["result"], len(missed), detail)

    def recent(self) -> list[Miss]:
        with self._lock:
            return list(self._recent)

    def collector(self) -> Collector:
        server = self

        class _Reports(Collector):
            def collect(self) -> Iterable[Metric]:
                with server._lock:
                    results, missed = dict(server.results), server.missed_ranks
                starts = CounterMetricFamily(
                    "weightcache_engine_alignment", "Engine starts by GPU alignment result",
                    labels=["cache", "namespace", "node", "result"])
                for result, n in results.items():
                    starts.add_metric([*server.where, result], n)
                ranks = CounterMetricFamily(
                    "weightcache_engine_alignment_missed_ranks",
                    "Engine ranks that started on a GPU not holding their shard",
                    labels=["cache", "namespace", "node"])
                ranks.add_metric(server.where, missed)
                return [starts, ranks]

        return _Reports()
