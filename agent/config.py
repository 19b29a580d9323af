"""Agent start-up configuration: downward-API environment, the placement plan, local devices.

The agent needs no Kubernetes API access: everything it must know arrives as environment
variables (downward API) and as the placement ConfigMap mounted as a file. Every problem
found here is a `ConfigError` with a message meant for a person reading pod logs, because a
pod that cannot start must say why in its last log line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from weightcache import constants
from weightcache.api.v1alpha1 import Ports, WeightCacheSpec
from weightcache.contracts.plan import MAX_PLAN_BYTES, Plan, PlanError
from weightcache.errors import ProjectError
from weightcache.native.shared.gpu import canonical_identity
from weightcache.native.shared.identity import cpu_identity


class ConfigError(ProjectError):
    """The agent cannot start with this environment or plan; the pod should restart."""


@dataclass(frozen=True)
class AgentEnv:
    """Identity of this agent pod, from the downward API."""

    cache: str
    namespace: str
    node: str
    pod_ip: str
    pod_name: str
    plan_path: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AgentEnv:
        env = os.environ if environ is None else environ
        required = (constants.ENV_CACHE_NAME, constants.ENV_NAMESPACE, constants.ENV_NODE_NAME)
        missing = [k for k in required if not env.get(k)]
        if missing:
            raise ConfigError(
                f"missing downward-API environment {', '.join(missing)}; "
                "the agent DaemonSet must set them from metadata and spec.nodeName"
            )
        return cls(
            cache=env[constants.ENV_CACHE_NAME],
            namespace=env[constants.ENV_NAMESPACE],
            node=env[constants.ENV_NODE_NAME],
            pod_ip=env.get(constants.ENV_POD_IP) or "0.0.0.0",
            pod_name=env.get(constants.ENV_POD_NAME, ""),
            plan_path=env.get(constants.ENV_PLAN) or constants.DEFAULT_PLAN_PATH,
        )


@dataclass(frozen=True)
class Device:
    """One local device a rank is pinned to. `index` is the position the child sees."""

    index: int
    uuid: str
    kind: str = "cuda"


@dataclass(frozen=True)
class AgentConfig:
    """Everything the supervisor and the runtimes need, fully validated."""

    env: AgentEnv
    plan: Plan
    node_rank: int
    node_count: int
    master_addr: str
    local_world_size: int
    devices: tuple[Device, ...]
    socket_dir: str
    ports: dict[str, int]
    load_timeout_s: float = 1800.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> WeightCacheSpec:
        return self.plan.spec

    @property
    def multi_node(self) -> bool:
        return self.node_count > 1

    @property
    def device_kind(self) -> str:
        return self.spec.device_kind


def parse_plan(text: str | bytes) -> Plan:
    """Validate a plan document (`Plan.from_json`) and what the agent needs of its spec."""
    try:
        plan = Plan.from_json(text)
    except PlanError as exc:
        raise ConfigError(str(exc)) from None
    path = plan.spec.model.path
    if "model" in plan.spec.malformed or not isinstance(path, str) or not path:
        raise ConfigError("plan: spec.model.path must be a non-empty string")
    return plan


def read_plan(path: str) -> Plan:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"plan: {path} does not exist; is the placement ConfigMap mounted?"
        ) from exc
    except OSError as exc:
        raise ConfigError(f"plan: cannot read {path}: {exc.strerror}") from exc
    return parse_plan(data)


Runner = Callable[[list[str]], str]


def _run_nvidia_smi(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def discover_devices(
    kind: str,
    count: int,
    environ: Mapping[str, str] | None = None,
    runner: Runner | None = None,
) -> list[Device]:
    """The local devices, in the order the child will index them.

    CPU "devices" are identities only (the native runtime on CPU serves one rank per slot),
    so any count is available. For CUDA the sources are, in order: NVIDIA_VISIBLE_DEVICES
    when it lists UUIDs (what the container runtime exposes), else nvidia-smi in PCI order
    (inside a container the NVIDIA runtime already limits it to the visible GPUs, so indices
    in NVIDIA_VISIBLE_DEVICES are not applied a second time).
    """
    env = os.environ if environ is None else environ
    if kind == "cpu":
        return [Device(index=i, uuid=cpu_identity(i), kind="cpu") for i in range(count)]
    visible = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if visible in ("none", "void"):
        raise ConfigError(f"NVIDIA_VISIBLE_DEVICES={visible}: this container sees no GPU")
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if visible == "all":
        items = []
    listed = [canonical_identity(v) for v in items]
    if items and all(listed):
        return [Device(index=i, uuid=str(u)) for i, u in enumerate(listed)]
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if runner is None and smi is None:
        raise ConfigError(
            "no GPU found: NVIDIA_VISIBLE_DEVICES lists no GPU UUIDs and nvidia-smi is not "
            "on PATH (does the pod use the NVIDIA runtime class?)"
        )
    argv = [smi or "nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]
    try:
        out = (runner or _run_nvidia_smi)(argv)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"nvidia-smi failed: {exc}") from exc
    found: list[str] = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        uuid = canonical_identity(parts[1]) if len(parts) == 2 else None
        if uuid:
            found.append(uuid)
    return [Device(index=n, uuid=u) for n, u in enumerate(found)]


def _ports(spec: WeightCacheSpec) -> dict[str, int]:
    """The plan's ports by spec name (defaults from the API), each checked to be a port."""
    if "ports" in spec.malformed:
        raise ConfigError("plan: spec.ports must be an object")
    ports = spec.ports.by_name()
    for key in Ports.NAMES:
        value = ports[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise ConfigError(f"plan: spec.ports.{key} must be a port number, got {value!r}")
    return ports


def build_config(
    env: AgentEnv,
    plan: Plan,
    environ: Mapping[str, str] | None = None,
    runner: Runner | None = None,
) -> AgentConfig:
    """Work out this node's place in the group and pin its ranks to local devices."""
    environ = os.environ if environ is None else environ
    if (plan.cache, plan.namespace) != (env.cache, env.namespace):
        raise ConfigError(
            f"plan is for cache {plan.namespace}/{plan.cache}, this agent serves "
            f"{env.namespace}/{env.cache}: wrong ConfigMap mounted"
        )
    if env.node not in plan.nodes:
        raise ConfigError(
            f"node {env.node!r} is not in the placement plan of {env.namespace}/{env.cache} "
            f"(planned: {', '.join(sorted(plan.nodes))}); this pod should not run here"
        )
    node_rank = plan.nodes[env.node]
    local_world = plan.ranks_per_node
    # vLLM's daemons rendezvous across nodes; native ranks need no rendezvous.
    if plan.node_count > 1 and not plan.master_addr and plan.runtime == "vllm":
        raise ConfigError("plan: masterAddr is required when the group spans nodes")
    kind = plan.spec.device_kind
    devices = discover_devices(kind, local_world, environ, runner)
    if len(devices) < local_world:
        raise ConfigError(
            f"this node has {len(devices)} usable GPU(s) but the plan needs {local_world} "
            f"local rank(s) (world {plan.layout.world_size} over {plan.node_count} node(s))"
        )
    socket_dir = environ.get("WEIGHTCACHE_AGENT_SOCKET_DIR") or str(plan.spec.socket_dir)
    if not os.path.isabs(socket_dir):
        raise ConfigError(f"socket dir {socket_dir!r} must be an absolute path")
    timeout = environ.get("WEIGHTCACHE_LOAD_TIMEOUT_S")
    try:
        load_timeout = float(timeout) if timeout else 1800.0
    except ValueError as exc:
        raise ConfigError(f"WEIGHTCACHE_LOAD_TIMEOUT_S={timeout!r} is not a number") from exc
    return AgentConfig(
        env=env,
        plan=plan,
        node_rank=node_rank,
        node_count=plan.node_count,
        master_addr=plan.master_addr or "127.0.0.1",
        local_world_size=local_world,
        devices=tuple(devices[:local_world]),
        socket_dir=socket_dir,
        ports=_ports(plan.spec),
        load_timeout_s=load_timeout,
    )


def load(environ: Mapping[str, str] | None = None, runner: Runner | None = None) -> AgentConfig:
    env = AgentEnv.from_environ(environ)
    return build_config(env, read_plan(env.plan_path), environ, runner)
