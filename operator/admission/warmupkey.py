"""What would make an injected vLLM engine miss the warmup caches its daemon wrote.

The daemon's FlashInfer autotune table and the compile caches are keyed by
`VllmConfig.compute_hash()` (and, for torch.compile, by `envs.compile_factors()`): an engine
flag or `VLLM_*` variable that the daemon's `vllm preload` does not share puts the engine
under another key, so it tunes and compiles again on every new node (it still starts, and
still maps the weights). vLLM 0.33 flags measured to change the key: `--max-num-seqs`,
`--max-num-batched-tokens`, `--max-model-len`, `--block-size`, `--enforce-eager`, `-O`
(`--kv-cache-dtype` too, which the weight fingerprint already compares); not
`--gpu-memory-utilization`, `--enable-prefix-caching`, `--port`, `--served-model-name`
(tests/conformance/test_warmup.py checks both lists against vLLM's own hash).
"""

from __future__ import annotations

from weightcache.operator.admission.cacheview import CacheView
from weightcache.operator.admission.cmdline import flag_values

# (flag, its aliases) whose value enters vLLM's config hash.
VALUE_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--max-num-seqs",),
    ("--max-num-batched-tokens",),
    ("--max-model-len",),
    ("--block-size",),
    ("--optimization-level", "-O"),
)
BOOLEAN_FLAGS: tuple[tuple[str, str], ...] = (("--enforce-eager", "--no-enforce-eager"),)
# Variables `compile_factors()` leaves out of the key (vllm/envs.py, its ignore list): where a
# cache or config lives, device selection, logging. Any other VLLM_* enters it.
KEY_IGNORED_VARS = frozenset({
    "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_ENABLE_STARTUP_PLAN",
    "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_PREFIX", "VLLM_CONFIGURE_LOGGING", "VLLM_HOST_IP", "VLLM_PORT",
    "VLLM_RPC_BASE_PATH", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_USAGE_SOURCE",
    "VLLM_TARGET_DEVICE", "VLLM_API_KEY", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
})


def _last(tokens: list[str], names: tuple[str, ...]) -> str | None:
    values = flag_values(tokens, *names)
    if "-O" in names:
        # -O3 and -O.level=3 style: the level glued to the flag.
        for tok in tokens:
            if tok.startswith("-O") and len(tok) > 2 and tok[2:3].isdigit():
                values.append(tok[2:])
    return values[-1] if values else None


def _state(tokens: list[str], on: str, off: str) -> bool:
    state = False
    for tok in tokens:
        key = tok.split("=", 1)[0].replace("_", "-")
        if key == on:
            state = True
        elif key == off:
            state = False
    return state


def daemon_tokens(cache: CacheView) -> list[str]:
    """The key-relevant flags the agent passes to `vllm preload`."""
    tokens: list[str] = []
    if cache.max_model_len:
        tokens += ["--max-model-len", str(cache.max_model_len)]
    return tokens + list(cache.extra_args)


def differences(tokens: list[str], cache: CacheView, container: str | None) -> list[str]:
    """Warnings for engine flags that key the warmup caches differently from the daemon's."""
    daemon = daemon_tokens(cache)
    out: list[str] = []
    for names in VALUE_FLAGS:
        engine, ours = _last(tokens, names), _last(daemon, names)
        if engine != ours:
            out.append(_say(container, names[0], engine, ours))
    for on, off in BOOLEAN_FLAGS:
        engine_on, ours_on = _state(tokens, on, off), _state(daemon, on, off)
        if engine_on != ours_on:
            out.append(_say(container, on, "set" if engine_on else None,
                            "set" if ours_on else None))
    return out


def env_differences(env: list[dict], container: str | None) -> list[str]:
    """Warnings for `VLLM_*` variables of the engine that enter the compile-cache key."""
    out = []
    for item in env:
        name = str(item.get("name") or "")
        if name.startswith("VLLM_") and name not in KEY_IGNORED_VARS:
            out.append(
                f"container {container!r} sets {name}, which enters vLLM's compile-cache key "
                f"(envs.compile_factors) while the cache's daemon runs without it: the engine "
                f"compiles and tunes under another key instead of reusing the node's warmup "
                f"cache"
            )
    return out


def _say(container: str | None, flag: str, engine: str | None, ours: str | None) -> str:
    return (
        f"container {container!r} has {flag} {engine if engine is not None else '(unset)'}, "
        f"the cache's daemon {ours if ours is not None else '(unset)'}: vLLM's config hash "
        f"differs, so the engine does not find the daemon's FlashInfer autotune table or "
        f"compile cache and tunes again (set the same value in spec.engineArgs)"
    )
