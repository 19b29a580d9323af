"""The words more than one program uses: runtimes, devices, dtypes, loader modes, model roles,
the node-readiness label value and exit codes.

Each is written here once so the CRD enum, the spec validator, the webhook, the agent, the
launcher, the daemon and the engine client cannot drift apart. Torch-free and pure: the
operator and the agent import it without torch.
"""

from __future__ import annotations

# Daemon implementations the agent can supervise (`spec.runtime`, the plan's `runtime`).
RUNTIMES = ("native", "vllm")
# Device kinds of runtime `native` (`spec.device`).
DEVICES = ("cpu", "cuda")
# `--dtype` of the daemons and `spec.engineArgs.dtype`: floating-point tensors are converted
# to it, "auto" keeps the checkpoint's own (vLLM's `--dtype` choices a weight cache serves).
DTYPES = ("auto", "bfloat16", "float16", "float32")
# How an engine takes the cached weights (`spec.engine.mode`, `weightcache.io/mode`,
# WEIGHTCACHE_MODE): map the daemon's arena, or copy it into the engine's own memory.
MODES = ("zero_copy", "copy")

# Model roles of a daemon rank: the model the engine serves, and its speculative draft.
# "target" is speculative decoding's word for the served model, and the value of the gRPC API's
# and the metrics' `role`. Socket file names do not spell the role: native sockets are
# `<identity>.sock` / `<identity>_draft.sock`, vLLM's `<md5 of the GPU UUID>` with `_draft`.
ROLE_TARGET = "target"
ROLE_DRAFT = "draft"
ROLES = (ROLE_TARGET, ROLE_DRAFT)
# Older name of the target role, still accepted by a daemon rank's `--role` and the client.
ROLE_ALIASES = {"main": ROLE_TARGET}

# Values of the node label `<namespace>.cache.weightcache.io/<name>` (constants.node_ready_label):
# `ready` on nodes where the whole cache is ready, `loading` on placed nodes whose agent pod runs
# while the cache is not ready yet. The webhook's injected node affinity requires one of them
# and prefers `ready`, so on a node new to the model an engine starts its interpreter, imports
# and CUDA context while the daemon loads, and attaches the moment its rank is ready.
READY_VALUE = "ready"
LOADING_VALUE = "loading"
NODE_LABEL_VALUES = (READY_VALUE, LOADING_VALUE)

# Exit codes of `weightcache preload` and of its daemon ranks (`python -m
# weightcache.native.daemon`), docs/native.md; `weightcache attach` and `weightcache update`
# use EXIT_OK and EXIT_BAD_INPUT too.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_LOCKED = 3  # another daemon already serves this device
EXIT_SECURITY = 4  # socket directory or lock refused
# `weightcache update`: the group did not switch (refused or failed; docs/updates.md).
EXIT_UPDATE_FAILED = 1
# Exit codes of `weightcache agent` (docs/agent.md); 0 is EXIT_OK.
EXIT_CONFIG = 2
EXIT_RUNTIME = 3
EXIT_PORT = 4
EXIT_DAEMON = 5


def canonical_role(role: str) -> str:
    """`role` in this vocabulary (aliases resolved); ValueError for an unknown one."""
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role
