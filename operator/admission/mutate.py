"""Injection of an opted-in engine pod: pure functions from (pod, cache) to a JSON patch.

Nothing here talks to the API or to kopf, so the webhook handler, the tests and the
benchmark all run the exact same decisions. The decisions are:

* which container is the engine (annotation, else the one running vLLM's server, else
  the first one);
* how to hand the loader its settings: vLLM flags (`--load-format ipc_cache`,
  `--model-loader-extra-config`) for runtime `vllm`, environment variables for `native`;
* what the daemon's side of the socket needs from the pod: the host socket directory
  at the same path, the cache's uid (the daemon checks SO_PEERCRED), the isolation the
  runtime's memory export needs, and scheduling onto nodes where the cache is Ready;
* what the engine will silently get wrong (model, TP size, dtype, image tag), which
  becomes a warning instead of a disk fallback nobody notices.

Every step checks before it adds, so admitting an injected pod again changes nothing.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from weightcache import constants as C
from weightcache.contracts.vocabulary import MODES, READY_VALUE
from weightcache.operator.admission.alignment import inject_alignment
from weightcache.operator.spec import DEFAULT_ENGINE, DEFAULT_RUN_AS

SOCKET_VOLUME = "weightcache-sockets"
LOAD_FORMAT = "ipc_cache"
SHELLS = {"sh", "bash", "ash", "dash", "zsh", "ksh"}
VLLM_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


@dataclass(frozen=True)
class Isolation:
    """What an engine pod needs so the runtime's memory export can reach it.

    One row per runtime, kept in one table so measurements on real GPUs update the
    policy in one place (docs/gpu.md, "Isolation").
    """

    host_ipc: bool  # share the host IPC namespace and with it the host /dev/shm
    host_pid: bool  # share the host PID namespace
    private_shm_breaks: bool  # a pod-private /dev/shm mount hides the exporter's segments
    socket_read_only: bool  # mount the socket directory read-only
    why: str


ISOLATION: dict[str, Isolation] = {
    # Legacy CUDA IPC (vLLM's ipc_cache loader): needs a shared /dev/shm and PIDs that do not
    # collide with the exporter's. Seen working: agents hostPID + hostIPC, engines hostIPC only.
    # Read-only socket mounts are not yet verified against vLLM's loader, so the mount is rw.
    "vllm": Isolation(
        host_ipc=True,
        host_pid=False,
        private_shm_breaks=True,
        socket_read_only=False,
        why="vLLM's ipc_cache loader maps CUDA IPC handles, which need the host /dev/shm",
    ),
    # VMM file descriptors (or memfd on CPU) over SCM_RIGHTS: works across PID and IPC
    # namespaces with a private /dev/shm; only the socket directory is shared.
    "native": Isolation(
        host_ipc=False,
        host_pid=False,
        private_shm_breaks=False,
        socket_read_only=True,
        why="the native client receives file descriptors over the socket",
    ),
}


class Denied(Exception):
    """The pod cannot work with the cache as written; the message says what to change."""


@dataclass
class Result:
    """What the webhook answers: the patch, warnings for kubectl, mismatches for the event."""

    ops: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    container: str | None = None
    pod: dict[str, Any] | None = None  # the injected pod (the request's object when unchanged)


# ---------------------------------------------------------------------------- cache settings


@dataclass(frozen=True)
class CacheView:
    """The parts of a WeightCache that injection reads, with the schema's defaults applied."""

    name: str
    namespace: str
    runtime: str
    image: str | None
    socket_dir: str
    mode: str
    fallback: bool
    connect_timeout: float
    state_timeout: float
    uid: int
    gid: int
    model_path: str | None
    tensor: int
    dtype: str
    phase: str | None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> CacheView:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace", "default")
        engine = {**DEFAULT_ENGINE, **(spec.get("engine") or {})}
        run_as = {**DEFAULT_RUN_AS, **(spec.get("runAs") or {})}
        return cls(
            name=name,
            namespace=namespace,
            runtime=spec.get("runtime") or "native",
            image=spec.get("image") or None,
            socket_dir=spec.get("socketDir") or C.default_socket_dir(namespace, name),
            mode=str(engine["mode"]),
            fallback=bool(engine["fallback"]),
            connect_timeout=float(engine["connectTimeoutSeconds"]),
            state_timeout=float(engine["stateTimeoutSeconds"]),
            uid=int(run_as["uid"]),
            gid=int(run_as["gid"]),
            model_path=(spec.get("model") or {}).get("path"),
            tensor=int((spec.get("parallelism") or {}).get("tensor") or 1),
            dtype=str((spec.get("engineArgs") or {}).get("dtype") or "auto"),
            phase=(obj.get("status") or {}).get("phase"),
        )


# ---------------------------------------------------------------------------- command lines


@dataclass
class Argv:
    """Where a container's command line lives and how to append to it.

    kind: `list` (vLLM in command/args), `shell` (vLLM inside a `sh -c` string),
    `entrypoint` (no command: the image's entrypoint gets args), `none` (some other program).
    """

    kind: str
    tokens: list[str]
    shell_field: str | None = None  # "command" or "args" holding the script
    shell_index: int | None = None


# Where flags go in a shell script: right after `vllm serve [MODEL]` or the server module, so
# they stay inside that command whatever follows it in the script.
_SERVE_RE = re.compile(
    r"(?:\bvllm\s+serve\b(?:[ \t]+(?![-'\"$])[^\s;&|()<>]+)?"
    r"|-m\s+(?:" + "|".join(re.escape(m) for m in VLLM_SERVER_MODULES) + r")\b)"
)


def _runs_vllm(tokens: list[str]) -> bool:
    for i, tok in enumerate(tokens):
        base = tok.rsplit("/", 1)[-1]
        if base == "vllm" and i + 1 < len(tokens) and tokens[i + 1] == "serve":
            return True
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] in VLLM_SERVER_MODULES:
            return True
        if tok in VLLM_SERVER_MODULES:
            return True
    return False


def _shell_script(container: dict[str, Any]) -> tuple[str, int, str] | None:
    """Find `sh -c SCRIPT` in command+args; return (field, index, script)."""
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    argv = command + args
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    for i, tok in enumerate(argv[1:], start=1):
        if tok.startswith("-") and not tok.startswith("--") and "c" in tok[1:]:
            if i + 1 >= len(argv):
                return None
            j = i + 1
            return (
                ("command", j, argv[j]) if j < len(command) else ("args", j - len(command), argv[j])
            )
        if not tok.startswith("-"):
            return None
    return None


CACHED_SCRIPT_CHARS = 8192  # longer scripts are split every time (bounds the cache's memory)


def _split_script(script: str) -> tuple[str, ...]:
    """Shell words of a script, with `;`, `&&`, `|` ... as words of their own.

    Cached: the pods of one Deployment or LeaderWorkerSet carry the same script, and shlex
    reads character by character (a quarter of a millisecond for a typical script).
    """
    if len(script) <= CACHED_SCRIPT_CHARS:
        return _split_cached(script)
    return _split_uncached(script)


@functools.lru_cache(maxsize=512)
def _split_cached(script: str) -> tuple[str, ...]:
    return _split_uncached(script)


def _split_uncached(script: str) -> tuple[str, ...]:
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return tuple(lexer)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        return tuple(script.split())


def parse_argv(container: dict[str, Any]) -> Argv:
    shell = _shell_script(container)
    if shell is not None:
        fld, idx, script = shell
        tokens = list(_split_script(script))
        if _SERVE_RE.search(script):
            return Argv("shell", tokens, fld, idx)
        return Argv("none", tokens, fld, idx)
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    tokens = command + args
    if _runs_vllm(tokens):
        return Argv("list", tokens)
    if not command and (not args or args[0].startswith("-")):
        return Argv("entrypoint", tokens)
    return Argv("none", tokens)


def flag_values(tokens: list[str], *names: str) -> list[str]:
    """Values of a flag given as `--flag value` or `--flag=value` (dashes or underscores)."""
    wanted = {n.replace("_", "-") for n in names}
    found: list[str] = []
    for i, tok in enumerate(tokens):
        if not tok.startswith("-"):
            continue
        key, eq, value = tok.partition("=")
        if key.replace("_", "-") not in wanted:
            continue
        if eq:
            found.append(value)
        elif i + 1 < len(tokens):
            found.append(tokens[i + 1])
    return found


def model_arg(tokens: list[str]) -> str | None:
    """The engine's model: `--model X` or the positional after `vllm serve`."""
    values = flag_values(tokens, "--model")
    if values:
        return values[-1]
    for i, tok in enumerate(tokens):
        if tok.rsplit("/", 1)[-1] == "vllm" and i + 2 < len(tokens) and tokens[i + 1] == "serve":
            candidate = tokens[i + 2]
            if not candidate.startswith("-"):
                return candidate
    return None


# ---------------------------------------------------------------------------- small helpers


def _annotations(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def extra_config(cache: CacheView, mode: str, fallback: bool) -> str:
    """The `--model-loader-extra-config` JSON: compact and key-sorted, so re-admission matches."""
    return json.dumps(
        {
            "socket_dir": cache.socket_dir,
            "mode": mode,
            "fallback": fallback,
            "connect_timeout_s": cache.connect_timeout,
            "state_timeout_s": cache.state_timeout,
        },
        separators=(",", ":"),
        sort_keys=True,
    )


def native_env(cache: CacheView, mode: str, fallback: bool) -> list[dict[str, str]]:
    return [
        {"name": C.ENV_SOCKET_DIR, "value": cache.socket_dir},
        {"name": C.ENV_MODE, "value": mode},
        {"name": C.ENV_FALLBACK, "value": "true" if fallback else "false"},
        {"name": C.ENV_CONNECT_TIMEOUT, "value": _num(cache.connect_timeout)},
        {"name": C.ENV_STATE_TIMEOUT, "value": _num(cache.state_timeout)},
        {"name": C.ENV_CACHE, "value": cache.name},
    ]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _image_ref(image: str) -> tuple[str, str | None, str | None]:
    """(repository, tag, digest) with Docker Hub's implicit prefixes made explicit."""
    ref, _, digest = image.partition("@")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    tag = None
    if colon > slash:
        ref, tag = ref[:colon], ref[colon + 1 :]
    first = ref.split("/", 1)[0]
    if "/" not in ref:
        ref = f"docker.io/library/{ref}"
    elif not ("." in first or ":" in first or first == "localhost"):
        ref = f"docker.io/{ref}"
    if tag is None and not digest:
        tag = "latest"
    return ref, tag, digest or None


def images_differ(pod_image: str, cache_image: str) -> bool:
    a, b = _image_ref(pod_image), _image_ref(cache_image)
    if a[2] and b[2]:
        return a[2] != b[2]
    return (a[0], a[1]) != (b[0], b[1])


# ---------------------------------------------------------------------------- engine container


def find_engine(pod: dict[str, Any], runtime: str) -> int:
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        raise Denied("the pod has no containers to inject the weight cache into")
    wanted = _annotations(pod).get(C.ANN_CONTAINER)
    if wanted:
        for i, c in enumerate(containers):
            if c.get("name") == wanted:
                return i
        names = ", ".join(repr(c.get("name")) for c in containers)
        raise Denied(
            f"annotation {C.ANN_CONTAINER}={wanted!r} names no container of this pod "
            f"(containers: {names}); set it to the engine container's name"
        )
    if runtime == "vllm":
        for i, c in enumerate(containers):
            if parse_argv(c).kind in {"list", "shell"}:
                return i
    return 0


# ---------------------------------------------------------------------------- the injection


def _overrides(pod: dict[str, Any], cache: CacheView) -> tuple[str, bool]:
    ann = _annotations(pod)
    mode = ann.get(C.ANN_MODE, cache.mode)
    if mode not in MODES:
        raise Denied(
            f"annotation {C.ANN_MODE}={mode!r} is not a cache mode; use one of {', '.join(MODES)}"
        )
    raw = ann.get(C.ANN_FALLBACK)
    if raw is None:
        fallback = cache.fallback
    elif raw.lower() in {"true", "false"}:
        fallback = raw.lower() == "true"
    else:
        raise Denied(f'annotation {C.ANN_FALLBACK}={raw!r} must be "true" or "false"')
    return mode, fallback


def _inject_flags(
    container: dict[str, Any], argv: Argv, cache: CacheView, mode: str, fallback: bool, res: Result
) -> None:
    name = container.get("name")
    formats = flag_values(argv.tokens, "--load-format")
    if formats and formats[-1] != LOAD_FORMAT:
        raise Denied(
            f"container {name!r} sets --load-format {formats[-1]}, which conflicts with the "
            f"weight cache (it needs --load-format {LOAD_FORMAT}); remove that flag, or remove "
            f"the {C.ANN_CACHE} annotation to load from disk"
        )
    wanted_config = extra_config(cache, mode, fallback)
    new: list[str] = []
    if not formats:
        new += ["--load-format", LOAD_FORMAT]
    configs = flag_values(argv.tokens, "--model-loader-extra-config")
    if configs:
        _check_user_config(configs[-1], cache, name, res)
    else:
        new += ["--model-loader-extra-config", wanted_config]
    if not new:
        return
    if argv.kind == "shell":
        holder = container[argv.shell_field]  # type: ignore[index]
        script = holder[argv.shell_index]
        match = _SERVE_RE.search(script)
        assert match is not None
        insert = " " + " ".join(shlex.quote(t) for t in new)
        holder[argv.shell_index] = script[: match.end()] + insert + script[match.end() :]
    else:
        container["args"] = [*list(container.get("args") or []), *new]


def _check_user_config(raw: str, cache: CacheView, name: str | None, res: Result) -> None:
    try:
        given = json.loads(raw)
    except ValueError:
        raise Denied(
            f"container {name!r} sets --model-loader-extra-config to something that is not JSON; "
            f"fix it or drop it and let the webhook set it"
        ) from None
    if not isinstance(given, dict):
        raise Denied(f"container {name!r}: --model-loader-extra-config must be a JSON object")
    socket_dir = given.get("socket_dir")
    if socket_dir is None and "socket_path" not in given:
        res.mismatches.append(
            f"container {name!r} sets --model-loader-extra-config without socket_dir: the engine "
            f"looks in its default per-user directory, not in {cache.socket_dir!r}, and falls back "
            f'to disk; add "socket_dir": "{cache.socket_dir}" or drop the flag'
        )
    elif socket_dir is not None and socket_dir != cache.socket_dir:
        res.mismatches.append(
            f"container {name!r} sets socket_dir {socket_dir!r} in --model-loader-extra-config, "
            f"but cache {cache.name!r} serves {cache.socket_dir!r}: the engine will not find the "
            f"daemon and falls back to disk"
        )


def _inject_env(container: dict[str, Any], cache: CacheView, mode: str, fallback: bool) -> None:
    env = list(container.get("env") or [])
    present = {e.get("name") for e in env}
    added = [e for e in native_env(cache, mode, fallback) if e["name"] not in present]
    if added:
        container["env"] = env + added


def _inject_mount(spec: dict[str, Any], container: dict[str, Any], cache: CacheView) -> None:
    iso = ISOLATION[cache.runtime]
    volume = {"name": SOCKET_VOLUME, "hostPath": {"path": cache.socket_dir, "type": "Directory"}}
    volumes = list(spec.get("volumes") or [])
    for v in volumes:
        if v.get("name") == SOCKET_VOLUME:
            if v != volume:
                raise Denied(
                    f"the pod already has a volume named {SOCKET_VOLUME!r} that is not the "
                    f"host socket directory {cache.socket_dir}; rename that volume"
                )
            break
    else:
        spec["volumes"] = [*volumes, volume]
    mount = {"name": SOCKET_VOLUME, "mountPath": cache.socket_dir}
    if iso.socket_read_only:
        mount["readOnly"] = True
    mounts = list(container.get("volumeMounts") or [])
    for m in mounts:
        if m.get("mountPath", "").rstrip("/") == cache.socket_dir.rstrip("/"):
            if m.get("name") != SOCKET_VOLUME:
                raise Denied(
                    f"container {container.get('name')!r} already mounts volume {m.get('name')!r} "
                    f"at {cache.socket_dir}, where the cache's sockets must appear; move that mount"
                )
            return
    container["volumeMounts"] = [*mounts, mount]


def _inject_identity(
    spec: dict[str, Any], container: dict[str, Any], cache: CacheView, res: Result
) -> None:
    pod_sc = spec.get("securityContext") or {}
    sc = dict(container.get("securityContext") or {})
    name = container.get("name")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if uid is not None and int(uid) != cache.uid:
        where = (
            "its securityContext.runAsUser"
            if "runAsUser" in sc
            else "the pod's securityContext.runAsUser"
        )
        raise Denied(
            f"container {name!r} runs as uid {uid} ({where}), but cache {cache.name!r} serves "
            f"uid {cache.uid} and its daemon accepts only that uid (SO_PEERCRED); remove "
            f"runAsUser or set it to {cache.uid}"
        )
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if gid is not None and int(gid) != cache.gid:
        res.warnings.append(
            f"container {name!r} runs as gid {gid}, cache {cache.name!r} runs as gid {cache.gid}; "
            f"the socket check is on the uid, so this works, but files the daemon shares are "
            f"group-owned by {cache.gid}"
        )
    changed = False
    if uid is None:
        sc["runAsUser"] = cache.uid
        changed = True
    if gid is None:
        sc["runAsGroup"] = cache.gid
        changed = True
    if changed:
        container["securityContext"] = sc


def _inject_isolation(
    spec: dict[str, Any], container: dict[str, Any], cache: CacheView, res: Result
) -> None:
    iso = ISOLATION[cache.runtime]
    if iso.host_ipc and not spec.get("hostIPC"):
        spec["hostIPC"] = True
    if iso.host_pid and not spec.get("hostPID"):
        spec["hostPID"] = True
    if iso.private_shm_breaks:
        for m in container.get("volumeMounts") or []:
            if m.get("mountPath", "").rstrip("/") == "/dev/shm":
                res.mismatches.append(
                    f"container {container.get('name')!r} mounts volume {m.get('name')!r} at "
                    f"/dev/shm, which hides the host /dev/shm that {iso.why}; remove that mount "
                    f"(hostIPC already gives the engine the host's shared memory)"
                )


def _inject_affinity(spec: dict[str, Any], cache: CacheView) -> None:
    expr = {
        "key": C.node_ready_label(cache.namespace, cache.name),
        "operator": "In",
        "values": [READY_VALUE],
    }
    affinity = spec.setdefault("affinity", {})
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        required["nodeSelectorTerms"] = [{"matchExpressions": [expr]}]
        return
    # Terms are ORed: the cache's label must hold in every one of them.
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        if expr not in exprs:
            exprs.append(expr)


def _check_mismatches(container: dict[str, Any], argv: Argv, cache: CacheView, res: Result) -> None:
    if cache.runtime != "vllm":
        return
    name = container.get("name")
    tail = "; the engine's fingerprint will not match and it falls back to loading from disk"
    model = model_arg(argv.tokens)
    if model is not None and cache.model_path and model.rstrip("/") != cache.model_path.rstrip("/"):
        res.mismatches.append(
            f"container {name!r} serves model {model!r}, cache {cache.name!r} holds "
            f"{cache.model_path!r}; unless both hold the same checkpoint the fingerprint will "
            f"not match and the engine falls back to loading from disk"
        )
    tp_values = flag_values(argv.tokens, "--tensor-parallel-size", "-tp")
    tp = tp_values[-1] if tp_values else "1"
    if tp != str(cache.tensor) and argv.kind != "none":
        res.mismatches.append(
            f"container {name!r} runs tensor-parallel size {tp}, cache {cache.name!r} holds "
            f"shards for {cache.tensor}{tail}"
        )
    dtypes = flag_values(argv.tokens, "--dtype")
    dtype = dtypes[-1] if dtypes else "auto"
    if dtype != cache.dtype and argv.kind != "none":
        res.mismatches.append(
            f"container {name!r} uses dtype {dtype}, cache {cache.name!r} holds {cache.dtype}{tail}"
        )
    image = container.get("image")
    if cache.image and image and images_differ(image, cache.image):
        res.mismatches.append(
            f"container {name!r} runs image {image!r}, cache {cache.name!r} was loaded by "
            f"{cache.image!r}; the fingerprint includes the vLLM version{tail}"
        )


def _copy(value: Any) -> Any:
    """Deep copy of JSON data (several times faster than copy.deepcopy)."""
    return json.loads(json.dumps(value))


def _shadow(pod: dict[str, Any], index: int) -> dict[str, Any]:
    """A copy of the pod that shares every part injection never modifies in place.

    The injectors replace lists and dicts rather than editing them, except inside the
    engine container and the affinity, which are copied deeply.
    """
    meta = dict(pod.get("metadata") or {})
    meta["labels"] = dict(meta.get("labels") or {})
    spec = dict(pod.get("spec") or {})
    containers = list(spec.get("containers") or [])
    containers[index] = _copy(containers[index])
    spec["containers"] = containers
    if "affinity" in spec:
        spec["affinity"] = _copy(spec["affinity"])
    return {**pod, "metadata": meta, "spec": spec}


SPEC_FIELDS = ("volumes", "hostIPC", "hostPID", "affinity")


def patch_ops(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch ops from `old` to `new` for the fields injection touches.

    Each changed field is written whole (`add` replaces an existing object member), each
    changed container is replaced whole: a generic list diff costs milliseconds per pod,
    these comparisons cost microseconds, and the result is as easy to read.
    """
    ops: list[dict[str, Any]] = []
    old_labels = (old.get("metadata") or {}).get("labels")
    new_labels = new["metadata"].get("labels")
    if new_labels != old_labels:
        ops.append({"op": "add", "path": "/metadata/labels", "value": new_labels})
    old_spec, new_spec = old.get("spec") or {}, new["spec"]
    for key in SPEC_FIELDS:
        if key in new_spec and new_spec[key] != old_spec.get(key):
            ops.append({"op": "add", "path": f"/spec/{key}", "value": new_spec[key]})
    old_containers = old_spec.get("containers") or []
    for i, (a, b) in enumerate(zip(old_containers, new_spec["containers"], strict=True)):
        if a != b:
            ops.append({"op": "replace", "path": f"/spec/containers/{i}", "value": b})
    return ops


def inject(pod: dict[str, Any], cache_obj: dict[str, Any] | CacheView | None) -> Result:
    """Decide the injection for one pod. Raises `Denied` when the pod cannot work as written.

    `Result.ops` is the JSON patch; `Result.pod` the injected pod (the request's own object
    when nothing changes, which is what makes re-admission a no-op).
    """
    res = Result(pod=pod)
    cache_name = _annotations(pod).get(C.ANN_CACHE)
    if not cache_name:
        return res
    if cache_obj is None:
        res.warnings.append(
            f"WeightCache {cache_name!r} not found in this namespace: the pod is admitted "
            f"unchanged and loads its weights from disk"
        )
        return res
    cache = cache_obj if isinstance(cache_obj, CacheView) else CacheView.from_object(cache_obj)
    if cache.runtime not in ISOLATION:
        res.warnings.append(
            f"WeightCache {cache.name!r} has runtime {cache.runtime!r}, which this webhook does "
            f"not know: the pod is admitted unchanged"
        )
        return res
    mode, fallback = _overrides(pod, cache)
    index = find_engine(pod, cache.runtime)
    new = _shadow(pod, index)
    spec = new["spec"]
    container = spec["containers"][index]
    res.container = container.get("name")
    argv = parse_argv(container)

    if cache.runtime == "native":
        _inject_env(container, cache, mode, fallback)
    elif argv.kind == "none":
        res.warnings.append(
            f"container {res.container!r} does not run vLLM's server (vllm serve or "
            f"python -m vllm.entrypoints.openai.api_server); the socket mount, identity and "
            f"scheduling are injected but no loader flags (a worker pod gets them from its leader)"
        )
    else:
        _inject_flags(container, argv, cache, mode, fallback, res)
        inject_alignment(container, argv.tokens, cache, res)
    _check_mismatches(container, argv, cache, res)
    _inject_mount(spec, container, cache)
    _inject_identity(spec, container, cache, res)
    _inject_isolation(spec, container, cache, res)
    _inject_affinity(spec, cache)
    new["metadata"]["labels"][C.LABEL_INJECTED] = cache.name
    if cache.phase != "Ready":
        label = C.node_ready_label(cache.namespace, cache.name)
        res.warnings.append(
            f"WeightCache {cache.name!r} is not Ready yet (phase {cache.phase or 'unknown'}): "
            f"the pod waits for a node labeled {label}={READY_VALUE}"
        )
    res.warnings.extend(res.mismatches)
    res.ops = patch_ops(pod, new)
    res.pod = new if res.ops else pod
    return res


def apply_ops(body: dict[str, Any], ops: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Apply a JSON patch (RFC 6902) to a copy of `body`."""
    return jsonpatch.apply_patch(body, list(ops))
