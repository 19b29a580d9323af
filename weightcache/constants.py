"""Names shared by the operator, the webhooks, the agent and the chart (docs/interfaces.md)."""

from __future__ import annotations

import hashlib

GROUP = "weightcache.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightCache"
PLURAL = "weightcaches"
SINGULAR = "weightcache"
SHORT_NAME = "wc"

# Pod opt-in and per-pod overrides.
ANN_CACHE = f"{GROUP}/cache"
ANN_CONTAINER = f"{GROUP}/container"
ANN_MODE = f"{GROUP}/mode"
ANN_FALLBACK = f"{GROUP}/fallback"
LABEL_INJECTED = f"{GROUP}/injected"

# Agent pods.
LABEL_APP = "app.kubernetes.io/name"
AGENT_APP = "weightcache-agent"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_CACHE = f"{GROUP}/cache"
LABEL_NODE_RANK = f"{GROUP}/node-rank"
# Pods of the warmup-directory cleanup Jobs (never the agent app label: the operator watches
# agent pods by it).
CLEANUP_APP = "weightcache-cleanup"
LABEL_CLEANUP = f"{GROUP}/cleanup"
ANN_EPOCH = f"{GROUP}/epoch"

DEFAULT_SOCKET_ROOT = "/var/run/weightcache"
# On disk (FHS /var/cache: regenerable, survives reboots), unlike the sockets' tmpfs /var/run.
DEFAULT_WARMUP_ROOT = "/var/cache/weightcache"
# The native daemons' own state, kept from one agent pod to the next (the import set): one
# directory per cache under this root, never mounted into engines. Derived, not a spec field:
# it is small (at most 32 MiB), shared with nobody, and /var/lib is writable wherever a node
# runs pods (the kubelet keeps its own state in /var/lib/kubelet).
DAEMON_STATE_ROOT = "/var/lib/weightcache/daemon-state"
PLAN_KEY = "plan.json"
DEFAULT_PLAN_PATH = "/etc/weightcache/plan.json"

DEFAULT_PORTS = {
    "rendezvous": 29600,
    "draftRendezvous": 29601,
    "health": 8478,
    "metrics": 9478,
    "grpc": 9479,
    "seed": 29700,
}

# Environment read by the native client library inside engine pods.
ENV_SOCKET_DIR = "WEIGHTCACHE_SOCKET_DIR"
ENV_MODE = "WEIGHTCACHE_MODE"
ENV_FALLBACK = "WEIGHTCACHE_FALLBACK"
ENV_CONNECT_TIMEOUT = "WEIGHTCACHE_CONNECT_TIMEOUT_S"
ENV_STATE_TIMEOUT = "WEIGHTCACHE_STATE_TIMEOUT_S"
# How long an engine waits for a daemon that is still loading its rank before loading from disk.
ENV_LOADING_WAIT = "WEIGHTCACHE_LOADING_WAIT_S"
ENV_CACHE = "WEIGHTCACHE_CACHE"
# The per-cache compile directory of weightcache's own torch.compile helpers (engine side).
ENV_COMPILE_DIR = "WEIGHTCACHE_COMPILE_DIR"
# A daemon rank's import set (weightcache.native.shared.importset): a file path, or "off".
ENV_IMPORT_SET = "WEIGHTCACHE_IMPORT_SET"
# Whether the rank imports torch only once its import set is read (1) or beside the read (0).
ENV_IMPORT_SET_WAIT = "WEIGHTCACHE_IMPORT_SET_WAIT"
# Whether a rank reads a cold import set in a process of its own (1) or in its own threads
# (0, default), beside its `import torch`, which holds the GIL those threads need.
ENV_IMPORT_SET_PROCESS = "WEIGHTCACHE_IMPORT_SET_PROCESS"
# Whether a rank's early reads wait for its import set to be read (1) or start at once, gentle
# until it is (0, default).
ENV_EARLY_READS_WAIT = "WEIGHTCACHE_EARLY_READS_WAIT"
# Whether a rank's early reads go on beside its fill (1, default) or stop when the fill begins
# (0: the earlier way, kept to compare).
ENV_EARLY_READS_BESIDE_FILL = "WEIGHTCACHE_EARLY_READS_BESIDE_FILL"
# Whether a job the fill reaches before any early read began it is read by the early readers
# for the fill (1: one set of readers at the disk) or by the fill itself (0, default: measured
# faster or the same, run47).
ENV_EARLY_READS_FOR_FILL = "WEIGHTCACHE_EARLY_READS_FOR_FILL"
# How many consecutive jobs of one file an early reader reads with one call while the rank
# starts (default 4: 64 MiB, as the device read does; 1: a job per call, the earlier way).
ENV_EARLY_READ_JOBS = "WEIGHTCACHE_EARLY_READ_JOBS"
# How many such jobs it reads with one call once the fill began (default 1: the fill waits for
# the jobs it takes; 4: 64 MiB, the depth the disk keeps while the rank starts; measured the
# same on an H100 VM, run54).
ENV_EARLY_READ_JOBS_BESIDE_FILL = "WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL"
# How a rank reads its import set ahead: "deep" (default: many readers, the kernel's readahead
# asked for each range at once, the directories and sources the import looks up) or "plain"
# (8 readers, one read at a time, file contents only: the earlier way, kept to compare).
ENV_IMPORT_SET_PREFETCH = "WEIGHTCACHE_IMPORT_SET_PREFETCH"
# How many threads read a cold import set (a deep prefetch's readers; default 32, at most 256):
# the set is many small files, so its read waits on the disk's latency, not its rate.
ENV_IMPORT_SET_THREADS = "WEIGHTCACHE_IMPORT_SET_THREADS"
# Whether a census that finds a rank's import set in memory but for a small part lets its early
# reads start at once (1, default) or the whole set is read first, as on a cold node (0: the
# earlier way, kept to compare).
ENV_IMPORT_SET_WARM = "WEIGHTCACHE_IMPORT_SET_WARM"
IMPORT_SET_NAME = "import-set.json"
# An import set recorded where the rank's libraries were installed (the agent image's build,
# `weightcache import-set record`): read ahead at a node's first start, before the node has a
# set of its own. Unset: none.
ENV_IMPORT_SET_SEED = "WEIGHTCACHE_IMPORT_SET_SEED"

# Environment of agent pods (downward API and plan path).
ENV_CACHE_NAME = "WEIGHTCACHE_CACHE_NAME"
ENV_NAMESPACE = "WEIGHTCACHE_NAMESPACE"
ENV_NODE_NAME = "NODE_NAME"
ENV_POD_IP = "POD_IP"
ENV_POD_NAME = "POD_NAME"
ENV_PLAN = "WEIGHTCACHE_PLAN"
# Where the agent reads the seed token (default: the Secret's mount, contracts/seed.py).
ENV_SEED_TOKEN_FILE = "WEIGHTCACHE_SEED_TOKEN_FILE"


def node_ready_label(namespace: str, name: str) -> str:
    """Node label key marking nodes where a cache is fully ready (prefix <= 253, name <= 63)."""
    return f"{namespace}.cache.{GROUP}/{name}"


def default_socket_dir(namespace: str, name: str) -> str:
    return f"{DEFAULT_SOCKET_ROOT}/{namespace}/{name}"


def default_warmup_dir(namespace: str, name: str) -> str:
    return f"{DEFAULT_WARMUP_ROOT}/{namespace}/{name}"


def daemon_state_dir(namespace: str, name: str) -> str:
    return f"{DAEMON_STATE_ROOT}/{namespace}/{name}"


def agent_daemonset_name(name: str) -> str:
    return f"{name}-agent"


def rendezvous_service_name(name: str) -> str:
    return f"{name}-rendezvous"


def placement_configmap_name(name: str) -> str:
    return f"{name}-placement"


def seed_secret_name(name: str) -> str:
    return f"{name}-seed"


def cleanup_job_name(name: str, node: str, uid: str = "") -> str:
    """One warmup-cache cleanup Job per node and cache object; the cache's uid and the node
    are hashed into the name so it stays a valid DNS label (<= 63) whatever the node's name
    is, and a re-created cache of the same name never collides with an earlier Job."""
    digest = hashlib.sha256(f"{name}/{uid}/{node}".encode()).hexdigest()[:12]
    return f"{name[:40]}-cleanup-{digest}"
