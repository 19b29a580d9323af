"""Runtime `native`: supervise `weightcache preload`, this project's own daemon.

The launcher takes vLLM's parallel flags, so local device i of node r serves global rank
`r * local + i` (TP rank `g % tp`, DP rank `g // tp`), the operator's layout. Native ranks need
no rendezvous (each computes its shard from the checkpoint), so the agent passes
`--nnodes/--node-rank` for groups spanning nodes and the DP placement flags for data
parallelism, and no master address or port. Each rank serves on
`<socket dir>/<device identity>.sock` (weightcache.native.shared.identity). Its sockets speak the
msgpack protocol of weightcache.native.shared.protocol, so the agent can also read each rank's
`stats` (requests, mismatches, attach histogram, watchers) for Prometheus.

Native shards follow tensor-parallel shard rules only: a dense model's DP replicas hold the
same shards, but expert parallelism across DP ranks would need per-DP-rank expert shards, so
that layout is refused.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

from weightcache.agent.config import AgentConfig, ConfigError
from weightcache.agent.runtimes.base import Probe, RankSpec, Runtime, http_json, socket_is_ours
from weightcache.contracts.layout import Layout, LocalRank, RankLayoutError
from weightcache.contracts.vocabulary import DTYPES, ROLE_TARGET
from weightcache.native.daemon.lifetime import python_module
from weightcache.native.shared.connection import PROBE_FRAME, connect, query, request
from weightcache.native.shared.errors import DaemonTimeoutError, WeightCacheError
from weightcache.native.shared.identity import socket_path as native_socket_path


def node_layout(cfg: AgentConfig) -> Layout:
    """The launcher's layout for this node, from the plan.

    With data parallelism the DP placement flags are passed as well (the plan's `dataLocal`
    and this node's first DP rank), so the launcher cross-checks them against `--nnodes`.
    Expert parallelism is left out: native shards follow tensor-parallel rules only, so the
    launcher has no use for the flag.
    """
    lay = cfg.plan.layout
    multi = cfg.multi_node
    dp = lay.data > 1
    return Layout(
        tensor=lay.tensor,
        data=lay.data,
        nodes=cfg.node_count if multi else 1,
        node_rank=cfg.node_rank if multi else 0,
        data_local=lay.data_local if dp else None,
        data_start=cfg.plan.data_start_rank(cfg.node_rank) if dp else None,
    )


class NativeRuntime(Runtime):
    name = "native"

    def __init__(self, cfg: AgentConfig) -> None:
        super().__init__(cfg)
        lay = cfg.plan.layout
        if lay.expert and lay.data > 1:
            raise ConfigError(
                "runtime native: expert parallelism across data-parallel ranks is not "
                f"supported (layout.expert with data={lay.data}); native shards follow "
                "tensor-parallel shard rules only, so use runtime vllm or data=1")
        self.layout = node_layout(cfg)
        try:
            self.placements: list[LocalRank] = self.layout.local_ranks()
        except RankLayoutError as exc:
            raise ConfigError(f"runtime native: the plan's layout cannot be served: {exc}") \
                from None
        if len(self.placements) != cfg.local_world_size:
            raise ConfigError(
                f"runtime native: {self.layout.describe()} serves {len(self.placements)} local "
                f"ranks but the plan gives this node {cfg.local_world_size}")
        if cfg.spec.engine_args.speculative_config:
            raise ConfigError("runtime native: speculative drafts are not cached; remove "
                              "engineArgs.speculativeConfig or use runtime vllm")

    def command(self) -> list[str]:
        cfg, spec = self.cfg, self.cfg.spec
        argv = [*python_module("weightcache.cli"), "preload",
                "--model", self.served_model(),
                *self.layout.to_args(),
                "--exit-with-parent",
                "--weight-cache-socket-dir", cfg.socket_dir,
                "--weight-cache-health-host", "127.0.0.1",
                "--weight-cache-health-port", str(cfg.ports["health"]),
                "--device", cfg.device_kind]
        dtype = spec.engine_args.effective_dtype
        if dtype not in DTYPES:
            raise ConfigError(f"runtime native: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        argv += ["--dtype", dtype]
        rules = spec.shard_rules
        if rules is not None:
            if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
                raise ConfigError("spec.shardRules must be a list of 'REGEX=DIM' strings")
            if not rules:
                argv.append("--no-shard-rules")
            for rule in rules:
                argv += ["--shard-rule", rule]
        return argv

    def environment(self) -> dict[str, str | None]:
        if self.cfg.device_kind == "cuda":
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                    "CUDA_VISIBLE_DEVICES": ",".join(d.uuid for d in self.cfg.devices)}
        return {}

    def ranks(self) -> list[RankSpec]:
        cfg = self.cfg
        return [
            RankSpec(role=ROLE_TARGET, global_rank=p.global_rank, tp_rank=p.tp_rank,
                     dp_rank=p.dp_rank, local_index=p.local, device=cfg.devices[p.local],
                     socket_path=str(native_socket_path(cfg.socket_dir, cfg.devices[p.local].uuid)))
            for p in self.placements
        ]

    def local_ports(self) -> list[tuple[str, int]]:
        return [("health", self.cfg.ports["health"])]

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.ports['health']}/health"

    def collect_stats(self) -> bool:
        return True

    def update_sockets(self) -> list[str]:
        return [r.socket_path for r in self.ranks()]

    def loading_bytes(self, timeout: float) -> dict[int, int]:
        """The launcher's /health lists each rank's `bytes_loaded` while it loads."""
        body = http_json(self.health_url(), timeout) or {}
        out: dict[int, int] = {}
        for rank in body.get("ranks") or []:
            if not isinstance(rank, dict):
                continue
            g, n = rank.get("rank"), rank.get("bytes_loaded")
            if type(g) is int and type(n) is int and n >= 0:
                out[g] = n
        return out

    def _request(self, path: str, cmd: str, timeout: float) -> tuple[socket.socket, dict[str, Any]]:
        """One request over the checked connect (directory, socket file and the daemon's uid
        by SO_PEERCRED): `socket_is_ours` before it is a check of the path, this one holds at
        the moment of connecting. WeightCacheError when it fails."""
        deadline = time.monotonic() + timeout
        sock = connect(path, timeout=timeout)
        try:
            reply, _ = request(sock, cmd, max_frame=PROBE_FRAME, deadline=deadline)
        except BaseException:
            sock.close()
            raise
        return sock, reply

    def probe(self, rank: RankSpec, timeout: float) -> Probe:
        why = socket_is_ours(rank.socket_path, self.cfg.socket_dir)
        if why:
            return Probe(ok=False, error=why)
        try:
            sock, mem = self._request(rank.socket_path, "get_memory", timeout)
            sock.close()
            if not mem.get("ok"):
                return Probe(ok=False, error=f"get_memory: {mem.get('error')}")
            sock, stats = self._request(rank.socket_path, "stats", timeout)
            sock.close()
        except WeightCacheError as exc:
            return Probe(ok=False, error=str(exc))
        nbytes = mem.get("bytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            return Probe(ok=False, error=f"get_memory returned bad bytes {nbytes!r}")
        return Probe(ok=True, bytes=nbytes, stats=stats if stats.get("ok") else None)

    def liveness(self, rank: RankSpec, timeout: float) -> str | None:
        """None when the rank answers `hello` within `timeout` (any reply, even `busy`,
        proves the process runs); otherwise why not. A SIGSTOPped or hung rank still has
        its socket and its watch connection, so only an answer tells it apart."""
        why = socket_is_ours(rank.socket_path, self.cfg.socket_dir)
        if why:
            return why
        try:
            query(rank.socket_path, "hello", timeout=timeout)
        except DaemonTimeoutError:
            return f"no answer to hello within {timeout:g}s"
        except WeightCacheError as exc:
            return f"hello failed: {exc}"
        return None

    def watch(self, rank: RankSpec, timeout: float) -> socket.socket | None:
        if socket_is_ours(rank.socket_path, self.cfg.socket_dir):
            return None
        try:
            sock, reply = self._request(rank.socket_path, "watch", timeout)
        except WeightCacheError:
            return None
        if not reply.get("ok"):
            with contextlib.suppress(OSError):
                sock.close()
            return None
        sock.setblocking(False)
        return sock
