"""Which visible GPU each engine rank should use so that it lands on a GPU caching its shard.

A node filled with TP replicas holds tp_rank `g % tp` on the GPU with NVML index `g` (the
agent's device order). The device plugin, not us, picks an engine's GPUs, and the engine maps
its local rank `i` to the i-th visible device: vLLM 0.33 `Worker.init_device`
(vllm/v1/worker/gpu_worker.py) takes `cuda:<logical_device_id_to_visible_device_id(local)>`,
and `Platform.device_id_to_physical_device_id` (vllm/platforms/interface.py) reads the i-th
entry of CUDA_VISIBLE_DEVICES, accepting GPU UUIDs there (`NvmlCudaPlatform.
device_control_id_to_physical_device_id`, vllm/platforms/cuda.py). So writing the allocated
GPUs' UUIDs into CUDA_VISIBLE_DEVICES in rank order before the engine starts makes rank `i`
run on a GPU holding shard `i` whenever the allocation holds every shard.

This file is the single home of that decision. The node agent publishes the map
(`build_map`) and, next to it, THIS FILE'S SOURCE as `python/sitecustomize.py`
(`sitecustomize_source`); the webhook puts that folder on a vLLM engine's PYTHONPATH, so
Python runs `apply_to_environ` at interpreter start-up, before vLLM imports torch, and the
stock vLLM image needs nothing of ours. Native clients call `align` through
weightcache.native.engine.rank_devices. Hence the rules for this module: standard library only, no
imports from weightcache, and nothing here may stop the engine from starting.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

MAP_NAME = "gpu-map.json"  # published by the agent in the socket directory
REPORT_SOCKET = "alignment.sock"  # the agent's listener for engines' alignment reports
MAP_VERSION = 1
MAX_MAP_BYTES = 256 * 1024
MAX_REPORT_BYTES = 16 * 1024
UUID_RE = re.compile(r"^GPU-[0-9A-Za-z-]{1,80}$")
# The canonical form the agent keys GPUs by (weightcache.native.shared.gpu.normalize_uuid:
# lower-case hex, 8-4-4-4-12); repeated here because engines run this file alone. A test keeps
# them equal.
_CANON_RE = re.compile(r"^(?:GPU-)?([0-9a-fA-F]{8}(?:-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12})$")
CPU_RE = re.compile(r"^cpu-[0-9a-f]{1,64}-[0-9]{1,6}$")
RESULTS = ("aligned", "partial", "missed", "skipped")
PYTHON_DIR = "python"  # <socket_dir>/python/sitecustomize.py, put on the engine's PYTHONPATH
# Environment the webhook injects into engine containers (docs/interfaces.md).
ENV_SOCKET_DIR = "WEIGHTCACHE_SOCKET_DIR"
ENV_TP = "WEIGHTCACHE_ALIGN_TP"
ENV_DP_LOCAL = "WEIGHTCACHE_ALIGN_DP_LOCAL"
ENV_DP_START = "WEIGHTCACHE_ALIGN_DP_START"
ENV_ACTIVE = "WEIGHTCACHE_ALIGN_DONE"
MARKER_NAME = "weightcache-alignment.json"


class MapError(ValueError):
    """The published map is not one this code can trust."""


@dataclass(frozen=True)
class Holding:
    """What the daemons on one GPU hold (one entry of the published map)."""

    uuid: str
    tp_rank: int
    tp_size: int
    dp_rank: int
    replica: int
    global_rank: int
    sockets: Mapping[str, str]  # role -> socket file name in the socket directory


@dataclass(frozen=True)
class GpuMap:
    identity: Mapping[str, object]  # cache, namespace, uid, epoch, runtime, model, tpSize, ...
    gpus: Mapping[str, Holding]


@dataclass(frozen=True)
class RankChoice:
    """Logical rank `local` (tp_rank `want_tp` of DP group `local // tp`) runs on `uuid`."""

    local: int
    uuid: str
    want_tp: int
    want_dp: int | None
    held_tp: int | None  # None: the GPU holds nothing of this cache
    hit: bool


@dataclass(frozen=True)
class Alignment:
    order: tuple[str, ...]  # the value for CUDA_VISIBLE_DEVICES, rank order first
    ranks: tuple[RankChoice, ...]

    @property
    def hits(self) -> int:
        return sum(r.hit for r in self.ranks)

    @property
    def result(self) -> str:
        if not self.ranks:
            return "skipped"
        if self.hits == len(self.ranks):
            return "aligned"
        return "partial" if self.hits else "missed"

    def misses(self) -> list[RankChoice]:
        return [r for r in self.ranks if not r.hit]


# ------------------------------------------------------------------------------ the map


def canonical(uuid: str) -> str:
    """`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` in lower case; anything else unchanged."""
    m = _CANON_RE.match(uuid.strip())
    if not m:
        return uuid.strip()
    h = m.group(1).replace("-", "").lower()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def build_map(identity: Mapping[str, object], holdings: Sequence[Holding]) -> dict:
    """The JSON document the agent publishes (docs/alignment.md, "The GPU map")."""
    gpus: dict[str, dict] = {}
    for h in holdings:
        entry = gpus.setdefault(canonical(h.uuid), {
            "tpRank": h.tp_rank, "tpSize": h.tp_size, "dpRank": h.dp_rank,
            "replica": h.replica, "globalRank": h.global_rank, "sockets": {},
        })
        entry["sockets"].update(h.sockets)
    return {"version": MAP_VERSION, "identity": dict(identity), "gpus": gpus}


def _int(entry: Mapping, key: str, where: str, minimum: int = 0) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MapError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_map(text: str | bytes) -> GpuMap:
    """Validate a published map; raise `MapError` naming the first bad field."""
    if len(text) > MAX_MAP_BYTES:
        raise MapError(f"map is {len(text)} bytes, more than {MAX_MAP_BYTES}")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MapError(f"map is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != MAP_VERSION:
        raise MapError(f"map version must be {MAP_VERSION}")
    identity, raw = doc.get("identity"), doc.get("gpus")
    if not isinstance(identity, dict) or not isinstance(raw, dict):
        raise MapError("map needs objects 'identity' and 'gpus'")
    gpus: dict[str, Holding] = {}
    for uuid, entry in raw.items():
        where = f"gpus[{uuid!r}]"
        if not (UUID_RE.match(uuid) or CPU_RE.match(uuid)) or not isinstance(entry, dict):
            raise MapError(f"{where} is not a GPU UUID with an object")
        tp_size = _int(entry, "tpSize", where, 1)
        tp_rank = _int(entry, "tpRank", where)
        if tp_rank >= tp_size:
            raise MapError(f"{where}.tpRank {tp_rank} is not below tpSize {tp_size}")
        sockets = entry.get("sockets") or {}
        if not isinstance(sockets, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in v and not v.startswith(".")
            for k, v in sockets.items()
        ):
            raise MapError(f"{where}.sockets must map roles to file names")
        uuid = canonical(uuid)
        gpus[uuid] = Holding(
            uuid=uuid, tp_rank=tp_rank, tp_size=tp_size, dp_rank=_int(entry, "dpRank", where),
            replica=_int(entry, "replica", where), global_rank=_int(entry, "globalRank", where),
            sockets=dict(sockets),
        )
    return GpuMap(identity=identity, gpus=gpus)


def read_map(socket_dir: str) -> GpuMap:
    path = os.path.join(socket_dir, MAP_NAME)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MAP_BYTES + 1)
    except OSError as exc:
        raise MapError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_map(data)


# ------------------------------------------------------------------------------ the decision


def align(
    visible: Sequence[str],
    gpus: Mapping[str, Holding],
    tp_size: int,
    *,
    dp_local: int = 1,
    dp_start: int | None = None,
) -> Alignment:
    """Order `visible` so that logical rank `j` gets a GPU holding tp_rank `j % tp_size`.

    A dense model's DP replicas hold identical shards (vLLM fingerprints every dense DP rank
    as `(1, 0)`, `get_engine_dp_placement` in weight_cache/daemon.py), so any replica's GPU
    serves a rank; pass `dp_start` only when the DP rank is part of the shard (expert
    parallel), which then must match too. Each GPU holds one key, so a greedy pick per rank
    finds the largest possible number of hits; among equal candidates the group's replica is
    preferred (its GPUs are the NVLink/PCIe-switch neighbours the planner laid out), then the
    visible order. Ranks left without a matching GPU take the remaining GPUs in visible order
    (those ranks load from disk). When nothing matches, the visible order is kept as given.
    """
    if tp_size < 1 or dp_local < 1:
        raise ValueError(f"tp_size and dp_local must be >= 1, got {tp_size}, {dp_local}")
    visible = list(dict.fromkeys(visible))  # a GPU listed twice is one GPU
    # Sources spell UUIDs differently (case, dashes): match on the canonical form, but write
    # back the strings the container itself reported.
    gpus = {u: h for u in visible if (h := gpus.get(canonical(u))) is not None}
    wanted = min(len(visible), tp_size * dp_local)
    free = list(visible)
    chosen: list[str | None] = [None] * wanted
    group_replica: dict[int, int] = {}
    for j in range(wanted):
        tp, group = j % tp_size, j // tp_size
        dp = None if dp_start is None else dp_start + group
        matches = [
            u for u in free
            if (h := gpus.get(u)) is not None and h.tp_size == tp_size and h.tp_rank == tp
            and (dp is None or h.dp_rank == dp)
        ]
        if not matches:
            continue
        if group in group_replica:
            same = [u for u in matches if gpus[u].replica == group_replica[group]]
            matches = same or matches
        pick = matches[0]
        group_replica.setdefault(group, gpus[pick].replica)
        chosen[j] = pick
        free.remove(pick)
    if not any(chosen):
        order = visible
        picks = visible[:wanted]
    else:
        rest = iter(free)
        picks = [c if c is not None else next(rest) for c in chosen]
        order = picks + [u for u in free if u not in picks]
    ranks = []
    for j, uuid in enumerate(picks):
        h = gpus.get(uuid)
        tp = j % tp_size
        dp = None if dp_start is None else dp_start + j // tp_size
        held = h.tp_rank if h is not None and h.tp_size == tp_size else None
        hit = held == tp and (dp is None or (h is not None and h.dp_rank == dp))
        ranks.append(RankChoice(local=j, uuid=uuid, want_tp=tp, want_dp=dp, held_tp=held, hit=hit))
    return Alignment(order=tuple(order), ranks=tuple(ranks))


def device_for_rank(alignment: Alignment, visible: Sequence[str], local: int) -> int:
    """The index in `visible` of the device logical rank `local` should use (native clients)."""
    return list(visible).index(alignment.order[local])


def describe(alignment: Alignment) -> str:
    """One line for logs and events: which ranks miss and on which GPUs."""
    if not alignment.ranks:
        return "no ranks to align"
    if alignment.result == "aligned":
        return f"all {len(alignment.ranks)} rank(s) on GPUs holding their shard"
    parts = []
    for r in alignment.misses():
        held = "nothing of this cache" if r.held_tp is None else f"tp_rank {r.held_tp}"
        parts.append(f"rank {r.local} (tp_rank {r.want_tp}) on {r.uuid}, which holds {held}")
    return (f"{len(parts)} of {len(alignment.ranks)} rank(s) load from disk: "
            + "; ".join(parts))


def report(alignment: Alignment, *, pod: str, reason: str = "") -> dict:
    """The JSON document an engine sends to the agent's REPORT_SOCKET (one per start)."""
    return {
        "pod": pod[:253],
        "result": alignment.result if not reason else "skipped",
        "reason": reason[:512],
        "ranks": [
            {"local": r.local, "gpu": r.uuid, "tpRank": r.want_tp, "heldTpRank": r.held_tp,
             "hit": r.hit}
            for r in alignment.ranks[:64]
        ],
    }


# ------------------------------------------------------------------------------ visible GPUs


def visible_from_env(nvidia_visible_devices: str | None) -> list[str] | None:
    """GPU UUIDs in NVIDIA_VISIBLE_DEVICES (what the NVIDIA device plugin sets with its
    default `--device-id-strategy=uuid`), or None when it names indices, `all` or nothing."""
    items = [v.strip() for v in (nvidia_visible_devices or "").split(",") if v.strip()]
    if items and all(UUID_RE.match(v) for v in items):
        return items
    return None


def visible_from_smi(output: str) -> list[str]:
    """UUIDs from `nvidia-smi --query-gpu=uuid --format=csv,noheader` (one per line)."""
    return [line.strip() for line in output.splitlines() if UUID_RE.match(line.strip())]


def discover_visible(environ: Mapping[str, str]) -> list[str]:
    found = visible_from_env(environ.get("NVIDIA_VISIBLE_DEVICES"))
    if found is not None:
        return found
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20, check=True,
    ).stdout
    return visible_from_smi(out)


# ------------------------------------------------------------------------------ engine side


def send_report(socket_dir: str, doc: dict, timeout: float = 1.0) -> bool:
    """Best effort: tell the agent (its metric counts misses). Never raises."""
    path = os.path.join(socket_dir, REPORT_SOCKET)
    data = json.dumps(doc, separators=(",", ":")).encode()[: MAX_REPORT_BYTES - 1] + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(data)
        return True
    except OSError:
        return False


def _say(message: str) -> None:
    print(f"weightcache: {message}", file=sys.stderr, flush=True)


def plan_environment(environ: Mapping[str, str]) -> tuple[Alignment | None, str, str]:
    """(alignment, reason it was skipped, socket dir) from the injected environment."""
    socket_dir = environ.get(ENV_SOCKET_DIR, "")
    if environ.get("CUDA_VISIBLE_DEVICES"):
        return None, "CUDA_VISIBLE_DEVICES is already set; its order is kept", socket_dir
    if "MIG-" in environ.get("NVIDIA_VISIBLE_DEVICES", ""):
        return None, "MIG devices are not aligned (the map names whole GPUs)", socket_dir
    tp = int(environ.get(ENV_TP) or "1")
    dp_local = int(environ.get(ENV_DP_LOCAL) or "1")
    dp_start = int(environ[ENV_DP_START]) if environ.get(ENV_DP_START) else None
    gpu_map = read_map(socket_dir)
    visible = discover_visible(environ)
    if not visible:
        return None, "no GPU UUIDs visible (NVIDIA_VISIBLE_DEVICES, nvidia-smi)", socket_dir
    return align(visible, gpu_map.gpus, tp, dp_local=dp_local, dp_start=dp_start), "", socket_dir


def _marker() -> str:
    """Where a container's first decision is kept (its writable /tmp, per container start)."""
    return os.path.join(tempfile.gettempdir(), MARKER_NAME)


def _reuse_marker(environ: MutableMapping[str, str]) -> bool:
    """Apply an earlier decision of this container (a `kubectl exec` interpreter, say)."""
    try:
        with open(_marker(), encoding="utf-8") as fh:
            order = json.load(fh).get("order")
    except (OSError, ValueError, AttributeError):
        return False
    if isinstance(order, str) and order:
        environ["CUDA_VISIBLE_DEVICES"] = order
    return True


def _write_marker(order: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".wc-align-", dir=tempfile.gettempdir())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"order": order}, fh)
        os.replace(tmp, _marker())
    except OSError:
        pass  # read-only root file system: later exec'd interpreters decide again


def apply_to_environ(environ: MutableMapping[str, str]) -> Alignment | None:
    """Set CUDA_VISIBLE_DEVICES in rank order, say so on stderr, report to the agent.

    Runs in the engine's first Python process, before CUDA starts; processes it starts inherit
    the variable and are left alone, and later interpreters of the same container (exec'd
    tools, probes) reuse its decision from a marker file, so each container start is decided,
    logged and counted once. Only raises for bugs (the caller swallows those too).
    """
    if not environ.get(ENV_TP) or environ.get(ENV_ACTIVE):
        return None
    environ[ENV_ACTIVE] = "1"  # once per process tree, whatever happens below
    if _reuse_marker(environ):
        return None
    try:
        alignment, reason, socket_dir = plan_environment(environ)
    except (MapError, OSError, ValueError, subprocess.SubprocessError) as exc:
        alignment, reason, socket_dir = None, str(exc), environ.get(ENV_SOCKET_DIR, "")
    pod = environ.get("POD_NAME") or socket.gethostname()
    if alignment is not None and alignment.hits:
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(alignment.order)
    _write_marker(environ.get("CUDA_VISIBLE_DEVICES", "") if alignment is not None else "")
    if alignment is None:
        _say(f"GPU alignment skipped: {reason}")
        return None
    line = describe(alignment)
    if alignment.result == "aligned":
        _say(f"GPU alignment: {line}; CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}")
    else:
        _say(f"WARNING GPU alignment {alignment.result}: {line}")
    send_report(socket_dir, report(alignment, pod=pod))
    return alignment


def _chain_sitecustomize() -> None:
    """Run the image's own sitecustomize (Debian's, say), which ours shadows on sys.path."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.realpath(globals().get("__file__") or "."))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def run_as_sitecustomize() -> None:
    """Entry point of the published sitecustomize.py: never stops the interpreter starting."""
    try:
        apply_to_environ(os.environ)
    except Exception as exc:
        _say(f"GPU alignment skipped: {type(exc).__name__}: {exc}")
    try:
        _chain_sitecustomize()
    except Exception as exc:
        _say(f"the image's sitecustomize failed: {type(exc).__name__}: {exc}")


_ENTRY = "run_as_sitecustomize()"


def sitecustomize_source() -> str:
    """This module's source plus its entry call: the agent publishes it as
    `<socket_dir>/python/sitecustomize.py`, the webhook puts that folder on PYTHONPATH."""
    with open(__file__, encoding="utf-8") as fh:
        source = fh.read()
    return f"{source}\n\n{_ENTRY}\n"
