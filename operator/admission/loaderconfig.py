"""The `--model-loader-extra-config` keys vLLM's `ipc_cache` loader accepts, per version.

`IpcModelLoader.__init__` (vllm/model_executor/model_loader/weight_cache/ipc_loader.py)
pops the keys it knows and raises `ValueError: Unexpected extra config keys for load format
ipc_cache` for anything left, and for a `mode` other than zero_copy/copy or a timeout that
`float()` refuses. Those raise at engine start: not a fallback to disk, a pod that never
serves. The webhook therefore denies what any supported version would refuse. `is_draft`
is accepted by the loader but set by the engine itself for its draft model; a user's value
would point the target at the draft sockets, so it is refused too.

The conformance suite (tests/conformance) constructs the real loader of each version with
every key here and checks these tables.
"""

from __future__ import annotations

from typing import Any

# vLLM version -> keys a user may set. Adding a version is one line (and its wheel in
# tests/conformance/VERSIONS).
ACCEPTED_KEYS: dict[str, frozenset[str]] = {
    "0.33.0": frozenset(
        {"socket_path", "socket_dir", "mode", "fallback", "connect_timeout_s", "state_timeout_s"}
    ),
}
INTERNAL_KEYS = frozenset({"is_draft"})  # accepted by the loader, set by the engine
MODES = ("zero_copy", "copy")
FLOAT_KEYS = ("connect_timeout_s", "state_timeout_s")


def accepted() -> frozenset[str]:
    """Keys every supported version accepts."""
    return frozenset.intersection(*ACCEPTED_KEYS.values())


def problems(config: dict[str, Any]) -> list[str]:
    """Why vLLM's loader would refuse `config` at engine start (empty: it accepts it)."""
    out: list[str] = []
    keys = accepted()
    unknown = sorted(set(config) - keys)
    if unknown:
        out.append(
            f"keys {', '.join(unknown)} are not accepted by vLLM's ipc_cache loader "
            f"(versions {', '.join(sorted(ACCEPTED_KEYS))}), which refuses to start on them; "
            f"accepted keys: {', '.join(sorted(keys))}"
        )
    mode = config.get("mode", "zero_copy")
    if mode not in MODES:
        out.append(f"mode {mode!r} is not one of {', '.join(MODES)}")
    for key in FLOAT_KEYS:
        if key in config and not _is_float(config[key]):
            out.append(f"{key} {config[key]!r} is not a number")
    return out


def _is_float(value: Any) -> bool:
    """What the loader's `float(...)` accepts (numbers, numeric strings, booleans)."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
