"""Prometheus metrics of the node agent (names fixed in docs/interfaces.md).

Everything is computed at scrape time from one supervisor snapshot by a custom collector,
so series of ranks that no longer exist disappear with them instead of going stale. The
native daemons' request counters reset when a daemon restarts; `_Accumulator` folds every
reset into a running total so the exported `_total` series stay monotonic per agent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from weightcache import __version__
from weightcache.agent.config import AgentConfig
from weightcache.agent.supervisor import Snapshot, State, Supervisor
from weightcache.agent.warmup import WarmupState
from weightcache.native.shared import protocol
from weightcache.native.shared.fingerprint import FIELDS as FINGERPRINT_FIELDS

# Every cache series names the cache, its namespace and the node; rank series also carry the
# GPU as DCGM exporter labels it (`UUID`, `Hostname`), so they join with DCGM_FI_DEV_* series
# (`on (UUID, Hostname)`) without label_replace.
CACHE_LABELS = ["cache", "namespace", "node"]
RANK_LABELS = [*CACHE_LABELS, "rank", "tp_rank", "dp_rank", "gpu_uuid", "role", "UUID", "Hostname"]
# Daemon results folded into three values so a misbehaving peer cannot grow label sets.
KNOWN_COMMANDS = frozenset((*protocol.COMMANDS, *protocol.UPDATE_COMMANDS))
UPDATE_RESULTS = frozenset({"ok", "refused", "timeout", "aborted", "rolled_back", "failed"})
# Mismatch labels: the fingerprint's fixed fields; anything else a daemon reports is `other`.
MISMATCH_FIELDS = frozenset(FINGERPRINT_FIELDS)
MAX_BUCKETS = 32  # histogram bounds taken from the daemons' stats (theirs are 14 + Inf)


def result_class(result: str) -> str:
    if result == "ok":
        return "ok"
    if result in ("fingerprint_mismatch", "mismatch"):
        return "mismatch"
    return "error"


class _Accumulator:
    """Monotonic totals over per-source counters that may reset to zero."""

    def __init__(self) -> None:
        self._last: dict[tuple, float] = {}
        self._total: dict[tuple, float] = {}

    def observe(self, source: tuple, series: tuple, value: float) -> None:
        key = (source, series)
        last = self._last.get(key, 0.0)
        delta = value - last if value >= last else value
        self._last[key] = value
        self._total[series] = self._total.get(series, 0.0) + delta

    def totals(self, prefix: str) -> dict[tuple, float]:
        return {k[1:]: v for k, v in self._total.items() if k[0] == prefix}


class AgentCollector(Collector):
    def __init__(self, cfg: AgentConfig, supervisor: Supervisor,
                 warm: WarmupState | None = None) -> None:
        self.cfg = cfg
        self.supervisor = supervisor
        self.warm = warm
        self._acc = _Accumulator()
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.supervisor.snapshot()
        cfg = self.cfg
        cache = cfg.env.cache
        where = [cache, cfg.env.namespace, cfg.env.node]
        info = InfoMetricFamily("weightcache_build", "Build of the weightcache node agent.")
        info.add_metric([], {"version": __version__, "runtime": cfg.plan.runtime})
        yield info
        ready = GaugeMetricFamily("weightcache_rank_ready",
                                  "Whether a local daemon rank serves its socket (1) or not (0).",
                                  labels=RANK_LABELS)
        cached = GaugeMetricFamily("weightcache_cached_bytes",
                                   "Bytes of weights a local daemon rank holds for engines.",
                                   labels=RANK_LABELS)
        load = GaugeMetricFamily("weightcache_load_duration_seconds",
                                 "Seconds from launch until the rank's socket answered.",
                                 labels=[*CACHE_LABELS, "rank", "role"])
        for r in snap.ranks:
            s = r.spec
            labels = [cache, cfg.env.namespace, cfg.env.node, str(s.global_rank), str(s.tp_rank),
                      str(s.dp_rank), s.device.uuid, s.role, s.device.uuid, cfg.env.node]
            ready.add_metric(labels, 1.0 if r.state == State.READY else 0.0)
            cached.add_metric(labels, float(r.bytes))
            if r.load_seconds is not None:
                load.add_metric([*where, str(s.global_rank), s.role], r.load_seconds)
        yield ready
        yield cached
        yield load
        restarts = CounterMetricFamily("weightcache_daemon_restarts",
                                       "Times the agent restarted its daemons.",
                                       labels=CACHE_LABELS)
        restarts.add_metric(where, float(snap.restarts))
        yield restarts
        agent_ready = GaugeMetricFamily("weightcache_agent_ready",
                                        "Whether every local rank of the cache is ready (1).",
                                        labels=CACHE_LABELS)
        agent_ready.add_metric(where, 1.0 if snap.ready else 0.0)
        yield agent_ready
        if self.warm is not None:
            yield from _warmup_metrics(self.warm, where)
        if self.supervisor.runtime.collect_stats():
            yield from self._daemon_stats(snap, where)

    def _daemon_stats(self, snap: Snapshot, where: list[str]) -> Iterator[Metric]:
        attached = GaugeMetricFamily(
            "weightcache_engines_attached",
            "Engines holding a watch connection on a rank (the agent's own watch excluded).",
            labels=[*CACHE_LABELS, "rank", "role"])
        buckets: list[str] = []
        generation = GaugeMetricFamily(
            "weightcache_cache_generation",
            "In-place update generation a rank serves (1: as loaded; +1 per update).",
            labels=[*CACHE_LABELS, "rank", "role"])
        with self._lock:
            for r in snap.ranks:
                st = r.stats
                if not st:
                    continue
                src = (r.spec.global_rank, r.spec.role)
                # Folded into fixed label sets first, then observed once per series, so
                # values folded together never look like a counter reset.
                folded: dict[tuple, float] = {}
                for cmd, per in _items(st.get("requests")):
                    command = cmd if cmd in KNOWN_COMMANDS else "other"
                    for result, n in _items(per):
                        key = ("req", command, result_class(str(result)))
                        folded[key] = folded.get(key, 0.0) + _num(n)
                for fld, n in _items(st.get("mismatches")):
                    key = ("mm", fld if fld in MISMATCH_FIELDS else "other")
                    folded[key] = folded.get(key, 0.0) + _num(n)
                hist = st.get("attach_seconds") or {}
                for pair in (hist.get("buckets") or [])[:MAX_BUCKETS]:
                    le = _bound(pair)
                    if le is None:
                        continue
                    if le not in buckets:
                        buckets.append(le)
                    folded[("bucket", le)] = _num(pair[1])
                for key, n in folded.items():
                    self._acc.observe(src, key, n)
                self._acc.observe(src, ("hsum",), _num(hist.get("sum", 0)))
                # Daemon-supplied: bounded and type-checked like the attach histogram above,
                # since one bad value raising here would fail the whole scrape.
                upd = st.get("updates")
                if isinstance(upd, dict) and upd:
                    generation.add_metric([*where, str(r.spec.global_rank), r.spec.role],
                                          _num(upd.get("generation", 1)))
                    for res, n in _items(upd.get("results")):
                        res = res if res in UPDATE_RESULTS else "other"
                        self._acc.observe(src, ("upd", res), _num(n))
                    for key in ("update_seconds", "pause_seconds"):
                        h = upd.get(key)
                        h = h if isinstance(h, dict) else {}
                        buckets_in = h.get("buckets")
                        for pair in (buckets_in if isinstance(buckets_in, list) else [])[
                                :MAX_BUCKETS]:
                            le = _bound(pair)
                            if le is not None:
                                self._acc.observe(src, (key, le), _num(pair[1]))
                        self._acc.observe(src, (key + "_sum",), _num(h.get("sum", 0)))
                watchers = int(_num(st.get("watchers", 0)))
                own = 1 if r.state == State.READY else 0
                attached.add_metric([*where, str(r.spec.global_rank), r.spec.role],
                                    float(max(watchers - own, 0)))
            req_totals = self._acc.totals("req")
            mm_totals = self._acc.totals("mm")
            bucket_totals = self._acc.totals("bucket")
            hsum = self._acc.totals("hsum").get((), 0.0)
            upd_totals = self._acc.totals("upd")
            upd_hists = {key: (self._acc.totals(key), self._acc.totals(key + "_sum").get((), 0.0))
                         for key in ("update_seconds", "pause_seconds")}
        requests = CounterMetricFamily("weightcache_daemon_requests",
                                       "Requests the native daemons answered, by result.",
                                       labels=[*CACHE_LABELS, "command", "result"])
        for (command, result), n in sorted(req_totals.items()):
            requests.add_metric([*where, command, result], n)
        yield requests
        mismatches = CounterMetricFamily(
            "weightcache_fingerprint_mismatches",
            "Attach attempts refused (engine fell back to disk), by fingerprint field.",
            labels=[*CACHE_LABELS, "field"])
        for (fld,), n in sorted(mm_totals.items()):
            mismatches.add_metric([*where, fld], n)
        yield mismatches
        hist_family = HistogramMetricFamily("weightcache_attach_duration_seconds",
                                            "Seconds the daemons spent serving get_state.",
                                            labels=CACHE_LABELS)
        ordered = sorted((b for b in bucket_totals if b[0] != "+Inf"), key=lambda b: float(b[0]))
        count = bucket_totals.get(("+Inf",), 0.0)
        pairs = [(b[0], bucket_totals[b]) for b in ordered] + [("+Inf", count)]
        hist_family.add_metric(where, pairs, hsum)
        yield hist_family
        yield attached
        yield generation
        updates = CounterMetricFamily("weightcache_updates",
                                      "In-place updates the ranks went through, by result.",
                                      labels=[*CACHE_LABELS, "result"])
        for (res,), n in sorted(upd_totals.items()):
            updates.add_metric([*where, res], n)
        yield updates
        for key, name, help_ in (
            ("update_seconds", "weightcache_update_duration_seconds",
             "Seconds an in-place update took on a rank, staging included."),
            ("pause_seconds", "weightcache_update_pause_seconds",
             "Seconds engines were paused by an in-place update (begin to finish)."),
        ):
            totals, total_sum = upd_hists[key]
            family = HistogramMetricFamily(name, help_, labels=CACHE_LABELS)
            if totals:
                bounds = sorted((b for b in totals if b[0] != "+Inf"), key=lambda b: float(b[0]))
                pairs = [(b[0], totals[b]) for b in bounds] + [("+Inf", totals.get(("+Inf",), 0))]
                family.add_metric(where, pairs, total_sum)
            yield family


def _warmup_metrics(warm: WarmupState, where: list[str]) -> Iterator[Metric]:
    """The node's warmup directory (agent/warmup.py): bytes by kind, reuse of autotune tables."""
    labels = [*CACHE_LABELS, "kind"]
    size = GaugeMetricFamily("weightcache_warmup_cache_bytes",
                             "Bytes in this cache's warmup directory on the node, by kind "
                             "(vllm, flashinfer, triton, inductor, torch).", labels=labels)
    hits = CounterMetricFamily("weightcache_warmup_cache_hits",
                               "Warmup artifacts a daemon start found and reused, by kind.",
                               labels=labels)
    misses = CounterMetricFamily("weightcache_warmup_cache_misses",
                                 "Warmup artifacts a daemon start had to write, by kind.",
                                 labels=labels)
    with warm.lock:
        for kind, n in sorted(warm.bytes_by_kind.items()):
            size.add_metric([*where, kind], float(n))
        for kind in sorted(set(warm.hits) | set(warm.misses)):
            hits.add_metric([*where, kind], float(warm.hits.get(kind, 0)))
            misses.add_metric([*where, kind], float(warm.misses.get(kind, 0)))
    yield size
    yield hits
    yield misses


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else []


def _bound(pair: Any) -> str | None:
    """The `le` label of one [bound, count] pair, or None when it is not one."""
    if not isinstance(pair, list | tuple) or len(pair) != 2:
        return None
    if str(pair[0]) == "+Inf":
        return "+Inf"
    return repr(float(pair[0])) if isinstance(pair[0], int | float) else None


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def build_registry(cfg: AgentConfig, supervisor: Supervisor,
                   warm: WarmupState | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(cfg, supervisor, warm))
    ProcessCollector(registry=registry)
    return registry
