"""`vllm preload`'s seed flags for this node (docs/warmup.md, "Seeding new replicas").

A cache without `warmup.seed.from` is a seed source: its daemons listen on the pod IP from
`ports.seed`. A cache with `from` is a target: node rank r dials the source's node rank r
(the address the operator put into the plan) and does not listen itself (vLLM's daemon has
one token for both roles, and this one is the source's). vLLM accepts the token only as a
flag; this process logs its child's argv and vllm agent pods share the host's PID namespace,
so the token reaches vLLM through a 0600 `--config` YAML file, never through argv.

Seeding never stops a launch: without a token, a peer, or with world size 1 (vLLM 0.33 seeds
only v1 per-rank tables), no seed flag is passed and the daemons tune by themselves.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass

from weightcache.agent.config import AgentConfig
from weightcache.contracts import seed as contract
from weightcache.native.shared import security

log = logging.getLogger("weightcache.agent.seed")
CONFIG_NAME = "seed.yaml"
MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True)
class Seeding:
    """What this node's daemons do: listen, dial, or neither (`why`)."""

    listen: tuple[str, int] | None = None
    source: tuple[str, int] | None = None
    why: str = ""

    @property
    def active(self) -> bool:
        return self.listen is not None or self.source is not None


def plan_seeding(cfg: AgentConfig) -> Seeding:
    """The endpoints of this node's daemons, from the spec and the plan."""
    spec = cfg.plan.spec
    why = contract.not_applicable(spec)
    if why is not None:
        return Seeding(why=why)
    source = spec.warmup.seed.from_
    if not source:
        if cfg.env.pod_ip in ("", "0.0.0.0"):
            return Seeding(why="the pod IP is unknown (POD_IP), so there is nothing to bind")
        return Seeding(listen=(cfg.env.pod_ip, int(spec.ports.seed)))
    peer = cfg.plan.seed_from
    if peer is None or peer.cache != source:
        return Seeding(why=f"the operator found no ready seed source {source} (the "
                           "WeightCache's Seeding condition says why)")
    host = peer.hosts.get(cfg.node_rank)
    if not host:
        return Seeding(why=f"{source} has no ready agent on node rank {cfg.node_rank}")
    return Seeding(source=(host, peer.port))


def read_token(path: str) -> str | None:
    """The mounted token, or None when the Secret is absent (optional volume) or unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError:
        return None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if not token or len(raw) > MAX_TOKEN_BYTES or not token.isprintable() or " " in token:
        return None
    return token


def write_config(directory: str, token: str) -> str:
    """`seed-token` in a YAML file only we can read; vLLM's FlexibleArgumentParser expands
    `--config FILE.yaml` into flags inside the process, so the token never reaches argv."""
    security.prepare_socket_dir(directory, make_private=True)
    path = os.path.join(directory, CONFIG_NAME)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".seed-", suffix=".yaml")
    try:
        os.fchmod(fd, 0o600)
        # A JSON string is a valid YAML double-quoted scalar.
        os.write(fd, f"seed-token: {json.dumps(token)}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def seed_args(cfg: AgentConfig, token_path: str, config_dir: str) -> list[str]:
    """The seed flags of `vllm preload` (empty when this node does not seed)."""
    seeding = plan_seeding(cfg)
    if not seeding.active:
        log.info("warmup seeding off: %s", seeding.why)
        return []
    token = read_token(token_path)
    if token is None:
        log.warning("warmup seeding off: no seed token at %s (the operator creates the "
                    "Secret; it appears in running pods within a minute)", token_path)
        return []
    out = ["--config", write_config(config_dir, token)]
    if seeding.listen is not None:
        out += ["--seed-listen-host", seeding.listen[0],
                "--seed-listen-port", str(seeding.listen[1])]
        log.info("seed source: listening on %s from port %d", *seeding.listen)
    if seeding.source is not None:
        out += ["--seed-source-host", seeding.source[0],
                "--seed-source-port", str(seeding.source[1])]
        log.info("seed target: adopting from %s port %d", *seeding.source)
    return out
