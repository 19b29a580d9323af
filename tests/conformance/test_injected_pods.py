"""Every injected engine pod shape, read by vLLM's own `serve` / api_server parser and loader.

The webhook's patch must give an engine that starts (vLLM's parser, `create_engine_config`
and the `IpcModelLoader` constructor accept it) and looks for the cache's daemons (the
loader's socket_dir, mode, fallback and timeouts are the cache's). Its fingerprint warnings
must agree with vLLM's `WeightCacheKey`: the daemon's key comes from the agent's real
`vllm preload` command for the cache, the engine's from the injected pod's command.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.admission import pods
from tests.admission.conftest import cache_obj
from tests.agent.plans import make_plan
from tests.conformance.conftest import Vllm, VllmRefused, runtime_for
from weightcache.operator.admission import cmdline, inject, loaderconfig, shellscript

MODEL = "/models/llama-3.1-8b"
# Key fields that differ between ranks or that neither side controls here.
PER_RANK = {"tp_rank", "dp_rank", "pp_rank"}


def engine_argv(pod: dict) -> list[str]:
    """The argv vLLM's parser gets from the injected engine container (program removed)."""
    container = pod["spec"]["containers"][0]
    argv = cmdline.parse_argv(container)
    if argv.kind == "shell":
        (cmd, *_) = shellscript.engine_commands(container[argv.shell_field][argv.shell_index])
        words = list(cmd.words)
    else:
        words = list(container.get("command") or []) + list(container.get("args") or [])
    if argv.kind == "entrypoint":
        return words  # the vllm/vllm-openai entrypoint is the api_server
    if words[0].rsplit("/", 1)[-1] == "vllm":
        return words[1:]
    return words[words.index("-m") + 2 :]


def with_model(pod: dict, model: str) -> dict:
    return json.loads(json.dumps(pod).replace(MODEL, model))


SHAPES = {
    "serve-args": lambda c: pods.serve_args_pod(c),
    "api-server-command": lambda c: pods.api_server_command_pod(c),
    "shell": lambda c: pods.shell_pod(c),
    "entrypoint-args": lambda c: pods.deployment_pod(c),
    "lws-leader": lambda c: pods.lws_pods(c)[0],
    "continuations": lambda c: pods.shell_pod(
        c, f"# start vllm serve\necho 'vllm serve'\nexec vllm serve \\\n  {MODEL} \\\n  --port 8000"
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("engine", [{}, {"mode": "copy", "fallback": False,
                                         "connectTimeoutSeconds": 2}])
def test_injected_pod_starts_and_finds_the_daemons(
    vllm: Vllm, models: dict[str, str], shape: str, engine: dict
) -> None:
    cache = cache_obj(name="llama", model={"path": models["dense"]}, engine=engine)
    pod = with_model(SHAPES[shape]("llama"), models["dense"])
    res = inject.inject(pod, cache)
    got = vllm.call("serve", argv=engine_argv(res.pod))
    assert got["load_format"] == "ipc_cache"
    view = inject.CacheView.from_object(cache)
    assert got["loader"] == {
        "socket_dir": view.socket_dir, "socket_path": None, "mode": view.mode,
        "fallback": view.fallback, "connect_timeout_s": view.connect_timeout,
        "state_timeout_s": view.state_timeout,
    }


CASES: list[tuple[list[str], dict[str, Any], dict[str, Any]]] = [
    # (engine flags, cache engineArgs, cache parallelism)
    ([], {}, {}),
    (["--dtype", "half"], {"dtype": "float16"}, {}),
    (["--dtype", "bfloat16"], {"dtype": "auto"}, {}),  # bf16 checkpoint: same to vLLM
    ([], {"dtype": "float16"}, {}),  # auto is bf16 here: differs, webhook cannot check
    (["--dtype", "float16"], {"dtype": "bfloat16"}, {}),
    (["--revision", "v2"], {"revision": "v1"}, {}),
    (["--quantization", "fp8"], {}, {}),
    (["--kv-cache-dtype", "fp8"], {}, {}),
    ([], {"extraArgs": ["--kv-cache-dtype", "fp8"]}, {}),
    (["--kv-cache-dtype=fp8"], {"extraArgs": ["--kv-cache-dtype", "fp8"]}, {}),
    (["-tp", "2"], {}, {"tensor": 2}),
    (["-tp", "2"], {}, {}),
    (["--moe-backend", "triton"], {}, {}),
]


@pytest.mark.parametrize(("flags", "engine_args", "parallelism"), CASES)
def test_webhook_warnings_agree_with_vllm_fingerprints(
    vllm: Vllm, models: dict[str, str], flags: list, engine_args: dict, parallelism: dict
) -> None:
    model = models["dense"]
    tp = parallelism.get("tensor", 1)
    plan = make_plan(tensor=tp, model=model, engine_args=engine_args)
    try:
        daemon = vllm.call("preload", argv=runtime_for(plan).command()[1:])["key"]
    except VllmRefused as exc:
        pytest.skip(f"vLLM {vllm.version} on CPU refuses this daemon config: {exc}")
    cache = cache_obj(name="llama", model={"path": model}, engineArgs=engine_args,
                      parallelism={"tensor": tp, **parallelism})
    pod = with_model(pods.serve_args_pod("llama", *flags), model)
    res = inject.inject(pod, cache)
    try:
        engine = vllm.call("serve", argv=engine_argv(res.pod))["key"]
    except VllmRefused as exc:
        pytest.skip(f"vLLM {vllm.version} on CPU refuses this engine config: {exc}")
    theirs = {k for k in daemon if daemon[k] != engine[k]} - PER_RANK
    ours = {d.field for d in res.differences}
    unchecked = {"dtype"} if any(w.startswith("could not check the dtype") for w in res.warnings) \
        else set()
    assert ours <= theirs, f"webhook warns about {ours - theirs}, vLLM's keys agree"
    assert theirs <= ours | unchecked, f"vLLM's keys differ in {theirs - ours}, webhook silent"


CANDIDATE_KEYS = sorted(
    loaderconfig.accepted() | loaderconfig.INTERNAL_KEYS
    | {"timeout", "socket", "draft", "fallback_to_disk", "connect_timeout"}
)
VALUES = {"socket_path": "/tmp/x.sock", "socket_dir": "/tmp", "mode": "copy", "fallback": True,
          "connect_timeout_s": 1, "state_timeout_s": 1, "is_draft": False}


@pytest.mark.parametrize("key", CANDIDATE_KEYS)
def test_loader_keys_table_is_vllms(vllm: Vllm, key: str) -> None:
    """ACCEPTED_KEYS[version] plus the internal keys are exactly what the loader takes."""
    config = {key: VALUES.get(key, 1)}
    try:
        vllm.call("loader", extra=config)
        vllm_accepts = True
    except VllmRefused as exc:
        assert "Unexpected extra config keys" in str(exc)
        vllm_accepts = False
    table = loaderconfig.ACCEPTED_KEYS[vllm.version] | loaderconfig.INTERNAL_KEYS
    assert (key in table) is vllm_accepts
    if not vllm_accepts:
        assert loaderconfig.problems(config)  # the webhook denies what vLLM refuses


@pytest.mark.parametrize(
    "config",
    [{"mode": "fast"}, {"connect_timeout_s": "soon"}, {"state_timeout_s": None},
     {"mode": "copy", "connect_timeout_s": "2.5", "fallback": False}],
)
def test_loader_values_the_webhook_denies_are_the_ones_vllm_refuses(
    vllm: Vllm, config: dict
) -> None:
    try:
        vllm.call("loader", extra=config)
        vllm_accepts = True
    except VllmRefused:
        vllm_accepts = False
    assert (loaderconfig.problems(config) == []) is vllm_accepts
