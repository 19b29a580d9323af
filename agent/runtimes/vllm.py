"""Runtime `vllm`: supervise the official `vllm preload` launcher from the engines' image.

The flags follow vLLM's own launcher (vllm/entrypoints/cli/preload.py and
weight_cache/daemon.py, vLLM 0.33):
- Global ranks enumerate DP then TP; node `r` serves the contiguous block
  `r * local_world .. r * local_world + local_world - 1`, local GPU `i` taking
  `dp_rank = g // tp`, `tp_rank = g % tp` (`Plan.local_ranks`, weightcache.contracts.layout).
- DP = 1: multi-node TP uses `--nnodes/--node-rank/--master-addr`.
- DP > 1 with whole DP ranks on each node: the DP placement flags
  (`--data-parallel-size-local`, `--data-parallel-start-rank`, `--data-parallel-address`);
  vLLM derives the node count as `dp / dp_local`.
- DP > 1 with a TP group spanning nodes (or one DP rank per node, which vLLM would
  otherwise switch to external load balancing, refused for dense models): both flag sets,
  `--nnodes/--node-rank/--master-addr` plus `--data-parallel-size/--data-parallel-address`.
- `--weight-cache-master-port` is required whenever the daemons span nodes; we always
  pass it so every launch is reproducible. Across nodes the DP address must not be
  loopback (vLLM refuses it).
- MTP/EAGLE/EAGLE3 drafts get their own daemon group, `*_draft.sock` sockets and
  `--weight-cache-draft-master-port` (passed explicitly; it must differ from the master port).
The child's health endpoint is bound to loopback: only the agent reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from typing import Any

from weightcache import constants
from weightcache.agent import seed, vllm_probe
from weightcache.agent.config import AgentConfig, ConfigError
from weightcache.agent.runtimes.base import Probe, RankSpec, Runtime, socket_is_ours
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import seed as seed_contract
from weightcache.contracts import warmup
from weightcache.contracts.vocabulary import ROLE_DRAFT, ROLE_TARGET

# Flags the agent derives from the plan; an extraArgs entry naming one is a conflict.
OWNED_FLAGS = frozenset({
    "--model", "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
    "--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-rank", "--data-parallel-address",
    "-dpa", "--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--enable-expert-parallel",
    "-ep", "--weight-cache-socket-dir", "--weight-cache-master-port",
    "--weight-cache-draft-master-port", "--weight-cache-health-port",
    "--weight-cache-health-host", "--dtype", "--quantization", "-q", "--revision",
    "--max-model-len", "--speculative-config", "--load-format", "--headless",
    "--data-parallel-external-lb", "--data-parallel-hybrid-lb", "--data-parallel-backend", "-dpb",
    "--no-enable-expert-parallel",
    # The seed channel between peer daemons (docs/warmup.md): its token must never be on argv
    # (the agent logs argv, and vllm agent pods share the host's PID namespace), and `--config`
    # could set any owned flag from a file.
    "--seed-listen-host", "--seed-listen-port", "--seed-source-host", "--seed-source-port",
    "--seed-token", "--config",
})
# vLLM normalises every *_mtp method to "mtp"; these draft methods get their own group.
DRAFT_METHODS = frozenset({"mtp", "eagle", "eagle3"})
LOOPBACK = ("127.0.0.1", "localhost")
# Without a method vLLM infers `mtp` from the draft checkpoint's config.json
# (vllm/config/speculative.py, SpeculativeConfig: `hf_config_override` rewrites the
# model_type, then `model_type in MTPModelTypes`). The model types and architectures below
# are the ones whose rewrite ends in an MTP type in vLLM 0.33 (tests/conformance checks each
# against vLLM's own function); any `*_mtp` model_type is one already.
MTP_BASE_MODEL_TYPES = frozenset({
    "dots3_note", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4",
    "pangu_ultra_moe", "kimi_k3", "ernie4_5_moe", "qwen3_next", "qwen4_exp", "qwen4_exp_text",
    "exaone_moe", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text",
    "longcat_flash",
})
MTP_BASE_ARCHITECTURES = frozenset({
    "MiMoForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    "GlmOcrForConditionalGeneration",
})


def _is_mtp_checkpoint(model: str) -> bool:
    """Whether vLLM would infer method `mtp` for a draft checkpoint (its config.json)."""
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"spec.engineArgs.speculativeConfig has no method and the draft's {path} cannot "
            f"be read ({exc.__class__.__name__}), so the agent cannot tell whether vLLM caches "
            f"the draft; set speculativeConfig.method"
        ) from None
    model_type = str(config.get("model_type") or "")
    archs = config.get("architectures") or []
    return (
        model_type.endswith("_mtp")
        or model_type in MTP_BASE_MODEL_TYPES
        or (bool(archs) and archs[0] in MTP_BASE_ARCHITECTURES)
    )


def draft_is_cached(spec_config: dict[str, Any] | None) -> bool:
    """Whether `vllm preload` starts a draft daemon group for this speculative config."""
    if not spec_config:
        return False
    method = str(spec_config.get("method") or "")
    if method == "mtp" or method.endswith("_mtp"):
        return True
    if method in DRAFT_METHODS:
        return True
    if method in ("", "draft_model"):
        # vLLM detects EAGLE heads from the draft model's name when no method is given,
        # then MTP from the draft checkpoint's model type.
        model = str(spec_config.get("model") or "")
        if method == "" and model in ("ngram", "[ngram]"):
            return False  # vLLM's n-gram proposer: no draft weights
        if "eagle-" in model.lower() or "eagle3" in model.lower():
            return True
        return bool(model) and _is_mtp_checkpoint(model)
    return False


def _flag_name(arg: str) -> str:
    """`--tensor_parallel_size=2` -> `--tensor-parallel-size` (vLLM's parser accepts both)."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def engine_args(spec: WeightCacheSpec) -> list[str]:
    """Pass-through engine arguments that also enter the daemons' fingerprint."""
    ea = spec.engine_args
    out: list[str] = []
    if ea.dtype:
        out += ["--dtype", str(ea.dtype)]
    if ea.quantization:
        out += ["--quantization", str(ea.quantization)]
    if ea.revision:
        out += ["--revision", str(ea.revision)]
    if ea.max_model_len:
        out += ["--max-model-len", str(int(ea.max_model_len))]
    if ea.speculative_config:
        out += ["--speculative-config",
                json.dumps(ea.speculative_config, sort_keys=True, separators=(",", ":"))]
    return out


def extra_args(spec: WeightCacheSpec) -> list[str]:
    extra = spec.engine_args.extra_args or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ConfigError("spec.engineArgs.extraArgs must be a list of strings")
    clash = sorted({_flag_name(a) for a in extra if _flag_name(a) in OWNED_FLAGS})
    if clash:
        raise ConfigError(
            f"spec.engineArgs.extraArgs sets {', '.join(clash)}, which the agent derives from "
            "the cache spec; use the spec fields instead"
        )
    return list(extra)


def parallel_args(cfg: AgentConfig) -> list[str]:
    lay = cfg.plan.layout
    tp, dp, nodes, rank = lay.tensor, lay.data, cfg.node_count, cfg.node_rank
    local = cfg.local_world_size
    out = ["--tensor-parallel-size", str(tp)]
    if lay.expert:
        out.append("--enable-expert-parallel")
    if dp == 1:
        if tp % nodes:
            raise ConfigError(f"tensor size {tp} does not split evenly over {nodes} nodes")
        if nodes > 1:
            out += ["--nnodes", str(nodes), "--node-rank", str(rank),
                    "--master-addr", cfg.master_addr]
        return out
    if nodes > 1 and cfg.master_addr in LOOPBACK:
        raise ConfigError("data parallelism across nodes needs a reachable master address")
    whole_dp_ranks = local % tp == 0 and (local // tp >= 2 or nodes == 1)
    if whole_dp_ranks:
        dp_local = local // tp
        out += ["--data-parallel-size", str(dp), "--data-parallel-size-local", str(dp_local)]
        if nodes > 1:
            out += ["--data-parallel-start-rank", str(cfg.plan.data_start_rank(rank)),
                    "--data-parallel-address", cfg.master_addr]
        return out
    out += ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", cfg.master_addr,
            "--data-parallel-size", str(dp), "--data-parallel-address", cfg.master_addr]
    return out


class VllmRuntime(Runtime):
    name = "vllm"

    def __init__(self, cfg: AgentConfig) -> None:
        super().__init__(cfg)
        self.binary = os.environ.get("WEIGHTCACHE_VLLM_BIN", "vllm")
        self.spec_config = cfg.spec.engine_args.speculative_config
        self.has_draft = draft_is_cached(self.spec_config)
        # The operator's token Secret (mounted read-only) and where the `--config` file that
        # carries it to vLLM is written (the pod's private /tmp).
        self.seed_token_path = os.environ.get(constants.ENV_SEED_TOKEN_FILE,
                                              seed_contract.TOKEN_PATH)
        self.seed_config_dir = os.path.join(tempfile.gettempdir(), "weightcache-seed")

    def command(self) -> list[str]:
        cfg, ports = self.cfg, self.cfg.ports
        exe = shutil.which(self.binary) or self.binary
        argv = [exe, "preload", "--model", str(cfg.spec.model.path)]
        argv += engine_args(cfg.spec)
        argv += parallel_args(cfg)
        argv += ["--weight-cache-master-port", str(ports["rendezvous"])]
        if self.has_draft:
            if ports["draftRendezvous"] == ports["rendezvous"]:
                raise ConfigError("ports.draftRendezvous must differ from ports.rendezvous")
            argv += ["--weight-cache-draft-master-port", str(ports["draftRendezvous"])]
        argv += ["--weight-cache-socket-dir", cfg.socket_dir,
                 "--weight-cache-health-host", "127.0.0.1",
                 "--weight-cache-health-port", str(ports["health"])]
        extra = extra_args(cfg.spec)
        argv += seed.seed_args(cfg, self.seed_token_path, self.seed_config_dir)
        return argv + extra

    def environment(self) -> dict[str, str | None]:
        # Index i in the child is exactly devices[i]: vLLM's local rank == device index.
        # The agent's own packages reach it through PYTHONPATH inside the vLLM image; vLLM
        # must import only the image's packages, so the variable is not passed on.
        # The warmup caches go to the node's shared directory, where the injected engines
        # look (weightcache.contracts.warmup); none of these variables enter vLLM's
        # compile-cache key, so the daemon and the engines compile under the same key.
        env: dict[str, str | None] = {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(d.uuid for d in self.cfg.devices),
            "PYTHONPATH": None,
        }
        if self.warmup_root:
            env.update(warmup.vllm_env(self.warmup_root))
        return env

    def ranks(self) -> list[RankSpec]:
        cfg = self.cfg
        roles = [(ROLE_TARGET, False)] + ([(ROLE_DRAFT, True)] if self.has_draft else [])
        out = []
        for role, draft in roles:
            for r in cfg.plan.local_ranks(cfg.node_rank):
                dev = cfg.devices[r.local]
                out.append(RankSpec(
                    role=role, global_rank=r.global_rank, tp_rank=r.tp_rank, dp_rank=r.dp_rank,
                    local_index=r.local, device=dev,
                    socket_path=vllm_probe.socket_path(cfg.socket_dir, dev.uuid, draft=draft),
                ))
        return out

    def local_ports(self) -> list[tuple[str, int]]:
        return [("health", self.cfg.ports["health"])]

    def watch(self, rank: RankSpec, timeout: float) -> socket.socket | None:
        if socket_is_ours(rank.socket_path, self.cfg.socket_dir):
            return None
        try:
            return vllm_probe.watch(rank.socket_path, timeout)
        except vllm_probe.ProbeError:
            return None

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.ports['health']}/health"

    def probe(self, rank: RankSpec, timeout: float) -> Probe:
        why = socket_is_ours(rank.socket_path, self.cfg.socket_dir)
        if why:
            return Probe(ok=False, error=why)
        try:
            return Probe(ok=True, bytes=vllm_probe.get_memory(rank.socket_path, timeout))
        except vllm_probe.ProbeError as exc:
            return Probe(ok=False, error=str(exc))

