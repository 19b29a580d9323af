"""The runtime seam: what the supervisor needs from a daemon implementation.

A runtime turns the validated `AgentConfig` into one child command line, says which ranks
(and sockets) that child will serve, and knows how to ask a rank's socket whether it is
serving. The supervisor only talks to this interface, so adding a runtime is a new module
plus one registry entry in `runtimes/__init__.py`.
"""

from __future__ import annotations

import http.client
import json
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from weightcache.agent.config import AgentConfig, Device
from weightcache.native.shared.security import socket_refusal


@dataclass(frozen=True)
class RankSpec:
    """One daemon rank this node serves: one model role on one local device."""

    role: str  # vocabulary.ROLES: "target" or "draft"
    global_rank: int
    tp_rank: int
    dp_rank: int
    local_index: int
    device: Device
    socket_path: str


@dataclass
class Probe:
    """The answer of one rank socket to the runtime's memory query."""

    ok: bool
    bytes: int = 0
    error: str = ""
    stats: dict[str, Any] | None = field(default=None)


class Runtime(ABC):
    """A daemon implementation the agent can supervise."""

    name: ClassVar[str]
    _model_override: str | None = None  # set by an in-place update (agent/update_rpc.py)
    # The checked identity directory of the warmup caches (agent/warmup.py), or None.
    warmup_root: str | None = None

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def command(self) -> list[str]:
        """The child's argv; argv[0] must be resolvable (checked by `check`)."""

    @abstractmethod
    def ranks(self) -> list[RankSpec]:
        """Every rank (and socket) the child serves on this node, in local order."""

    @abstractmethod
    def probe(self, rank: RankSpec, timeout: float) -> Probe:
        """Ask a rank's socket for its cached bytes; never raises."""

    def environment(self) -> dict[str, str | None]:
        """Environment changes for the child (device pinning and the like); None unsets."""
        return {}

    def watch(self, rank: RankSpec, timeout: float) -> socket.socket | None:
        """A connection that reaches EOF when the rank exits (None: not supported)."""
        return None

    def local_ports(self) -> list[tuple[str, int]]:
        """Loopback ports the child binds, checked free before each launch."""
        return []

    def health_url(self) -> str | None:
        """The child's own HTTP health endpoint, if it has one."""
        return None

    def loading_bytes(self, timeout: float) -> dict[int, int]:
        """Bytes each still-loading rank holds so far, by global rank ({}: not known)."""
        return {}

    def collect_stats(self) -> bool:
        """Whether `Probe.stats` carries request counters worth exporting."""
        return False

    def update_sockets(self) -> list[str] | None:
        """The sockets an in-place update goes to (None: this runtime cannot update in place)."""
        return None

    def served_model(self) -> str:
        """The checkpoint the child serves: the plan's, or the last in-place update's."""
        return str(self._model_override or self.cfg.spec.model.path)

    def serve_model(self, path: str) -> None:
        """After an in-place update: launch the child on `path` from now on."""
        self._model_override = path


def socket_is_ours(path: str, private_dir: str) -> str | None:
    """Why `path` must not be talked to, or None when it is a socket we own in our dir.

    The daemons' own checks (weightcache.native.shared.security: lstat, owner uid, no symlinks,
    private directory), so the agent never sends a request to a socket another user could
    have planted.
    """
    return socket_refusal(path, private_dir)


MAX_HEALTH_BODY = 1 << 20


def http_json(url: str, timeout: float) -> dict[str, Any] | None:
    """The child's health endpoint's JSON body (any status), or None; never raises."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                      timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        body = conn.getresponse().read(MAX_HEALTH_BODY + 1)
        if len(body) > MAX_HEALTH_BODY:
            return None
        value = json.loads(body)
        return value if isinstance(value, dict) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def http_health(url: str, timeout: float) -> bool:
    """True when the child's health endpoint answers 200.

    http.client rather than urllib: proxy variables in the pod must not reroute a loopback probe.
    """
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                      timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
