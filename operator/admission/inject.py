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
The command line is read by `cmdline`, the cache by `cacheview`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

from weightcache import constants as C
from weightcache.contracts.vocabulary import MODES, NODE_LABEL_VALUES, READY_VALUE
from weightcache.errors import ProjectError
from weightcache.operator.admission import fingerprint, loaderconfig, shellscript, warmupkey
from weightcache.operator.admission.alignment import inject_alignment
from weightcache.operator.admission.cacheview import CacheView
from weightcache.operator.admission.cmdline import (
    Argv,
    flag_values,
    parse_argv,
)

SOCKET_VOLUME = "weightcache-sockets"
WARMUP_VOLUME = "weightcache-warmup"
LOAD_FORMAT = "ipc_cache"


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


class Denied(ProjectError):
    """The pod cannot work with the cache as written; the message says what to change."""


@dataclass
class Result:
    """What the webhook answers: the patch, warnings for kubectl, mismatches for the event."""

    ops: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    differences: list[fingerprint.Difference] = field(default_factory=list)
    container: str | None = None
    pod: dict[str, Any] | None = None  # the injected pod (the request's object when unchanged)


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


# ---------------------------------------------------------------------------- engine container


def _parse_argv(container: dict[str, Any]) -> Argv:
    try:
        return parse_argv(container)
    except shellscript.Unclear as exc:
        raise Denied(
            f"container {container.get('name')!r}: {exc}, so the webhook cannot be sure where "
            f"vLLM's loader flags belong; put the vLLM command in command/args, or run it "
            f"directly in the script (sh -c 'exec vllm serve ...')"
        ) from None


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
            if _parse_argv(c).kind in {"list", "shell"}:
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
    if argv.kind == "shell":
        _insert_into_script(container, argv, cache, mode, fallback, res)
    elif new:
        container["args"] = [*list(container.get("args") or []), *new]


def _insert_into_script(
    container: dict[str, Any], argv: Argv, cache: CacheView, mode: str, fallback: bool, res: Result
) -> None:
    """Append the missing flags to every vLLM command of the script, after its last word.

    From the last command to the first, so earlier offsets stay valid. The first command
    was checked by `_inject_flags`; the others are checked the same way here.
    """
    holder = container[argv.shell_field]  # type: ignore[index]
    script = holder[argv.shell_index]
    for cmd in reversed(argv.commands):
        tokens = list(cmd.words)
        formats = flag_values(tokens, "--load-format")
        if formats and formats[-1] != LOAD_FORMAT:
            raise Denied(
                f"container {container.get('name')!r} runs a vLLM command with --load-format "
                f"{formats[-1]}, which conflicts with the weight cache (it needs --load-format "
                f"{LOAD_FORMAT}); remove that flag, or remove the {C.ANN_CACHE} annotation"
            )
        new: list[str] = []
        if not formats:
            new += ["--load-format", LOAD_FORMAT]
        configs = flag_values(tokens, "--model-loader-extra-config")
        if configs:
            if cmd is not argv.commands[0]:
                _check_user_config(configs[-1], cache, container.get("name"), res)
        else:
            new += ["--model-loader-extra-config", extra_config(cache, mode, fallback)]
        if new:
            insert = " " + " ".join(shlex.quote(t) for t in new)
            script = script[: cmd.insert_at] + insert + script[cmd.insert_at :]
    holder[argv.shell_index] = script


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
    refused = loaderconfig.problems(given)
    if refused:
        raise Denied(
            f"container {name!r} sets --model-loader-extra-config that vLLM's ipc_cache loader "
            f"refuses at start (the engine would not start): {'; '.join(refused)}; fix it or "
            f"drop the flag and let the webhook set it"
        )
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
    _mount_host_dir(spec, container, SOCKET_VOLUME, cache.socket_dir,
                    ISOLATION[cache.runtime].socket_read_only,
                    "host socket directory", "the cache's sockets")


def _mount_host_dir(spec: dict[str, Any], container: dict[str, Any], name: str, path: str,
                    read_only: bool, what: str, contents: str) -> None:
    """The hostPath `path` (type Directory) as volume `name`, mounted at the same path; a
    volume of that name or a mount at that path that is something else is a denial."""
    volume = {"name": name, "hostPath": {"path": path, "type": "Directory"}}
    volumes = list(spec.get("volumes") or [])
    for v in volumes:
        if v.get("name") == name:
            if v != volume:
                raise Denied(
                    f"the pod already has a volume named {name!r} that is not the "
                    f"{what} {path}; rename that volume"
                )
            break
    else:
        spec["volumes"] = [*volumes, volume]
    mount = {"name": name, "mountPath": path}
    if read_only:
        mount["readOnly"] = True
    mounts = list(container.get("volumeMounts") or [])
    for m in mounts:
        if m.get("mountPath", "").rstrip("/") == path.rstrip("/"):
            if m.get("name") != name:
                raise Denied(
                    f"container {container.get('name')!r} already mounts volume {m.get('name')!r} "
                    f"at {path}, where {contents} must appear; move that mount"
                )
            return
    container["volumeMounts"] = [*mounts, mount]


def _inject_warmup(
    spec: dict[str, Any], container: dict[str, Any], argv: Argv, cache: CacheView, res: Result
) -> None:
    """The node's warmup directory of this cache, read-write (engines add their own compile
    caches), and the variables that point vLLM / torch at its identity subdirectory
    (weightcache.contracts.warmup, the same the agent gives the daemons)."""
    if cache.warmup_dir is None:
        return
    name = container.get("name")
    _mount_host_dir(spec, container, WARMUP_VOLUME, cache.warmup_dir, False,
                    "cache's warmup directory", "the cache's warmup directory")
    env = list(container.get("env") or [])
    given = {e.get("name"): e for e in env}
    added = []
    for key, value in cache.warmup_env:
        if key not in given:
            added.append({"name": key, "value": value})
        elif given[key].get("value") != value:
            res.mismatches.append(
                f"container {name!r} sets {key} itself, not to the cache's warmup directory "
                f"{value}: the engine will not find the daemon's autotune table or its own "
                f"earlier compile cache; remove {key} and let the webhook set it"
            )
    if added:
        container["env"] = env + added
    if cache.runtime == "vllm":
        if argv.kind != "none":
            res.warnings += warmupkey.differences(argv.tokens, cache, name)
        res.warnings += warmupkey.env_differences(env, name)


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
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if non_root is True and cache.uid == 0:
        # The kubelet refuses to start it: "container's runAsUser breaks non-root policy"
        # (pkg/kubelet/kuberuntime/security_context_others.go, verifyRunAsNonRoot).
        where = "its securityContext" if "runAsNonRoot" in sc else "the pod's securityContext"
        raise Denied(
            f"container {name!r} sets runAsNonRoot: true ({where}), but cache {cache.name!r} "
            f"runs as uid 0 and its daemon accepts only that uid, so the engine must run as "
            f"root and the kubelet would refuse to start it; set the cache's runAs.uid to a "
            f"non-root uid, or drop runAsNonRoot"
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
    """Required: a node where the cache is ready or loading; preferred: a ready one.

    A node still loading the cache is acceptable because the engine's own start (interpreter,
    imports, CUDA context) then overlaps the daemon's load and the client waits for its rank
    (`WEIGHTCACHE_LOADING_WAIT_S`) instead of reading the disk beside it.
    """
    key = C.node_ready_label(cache.namespace, cache.name)
    expr = {"key": key, "operator": "In", "values": list(NODE_LABEL_VALUES)}
    affinity = spec.setdefault("affinity", {})
    node = affinity.setdefault("nodeAffinity", {})
    preferred = node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    prefer = {"weight": 100, "preference": {"matchExpressions": [
        {"key": key, "operator": "In", "values": [READY_VALUE]}]}}
    if prefer not in preferred:
        preferred.append(prefer)
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        required["nodeSelectorTerms"] = [{"matchExpressions": [expr]}]
        return
    # Terms are ORed: the cache's label must hold in every one of them. A pod's own expression
    # on the key stays (expressions are ANDed): one that requires `In [ready]` waits for ready.
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        if expr not in exprs:
            exprs.append(expr)


def _check_mismatches(container: dict[str, Any], argv: Argv, cache: CacheView, res: Result) -> None:
    if cache.runtime != "vllm":
        return
    diffs, notes = fingerprint.compare(container, argv, cache)
    res.differences += diffs
    res.mismatches += [str(d) for d in diffs]
    res.warnings += notes


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
    argv = _parse_argv(container)

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
    _inject_warmup(spec, container, argv, cache, res)
    _inject_identity(spec, container, cache, res)
    _inject_isolation(spec, container, cache, res)
    _inject_affinity(spec, cache)
    # Pod-level checks that read the injected pod (Pod Security warnings, GPU alignment)
    # are one call each here: after every injector, before the patch is computed.
    new["metadata"]["labels"][C.LABEL_INJECTED] = cache.name
    if cache.phase != "Ready":
        label = C.node_ready_label(cache.namespace, cache.name)
        res.warnings.append(
            f"WeightCache {cache.name!r} is not Ready yet (phase {cache.phase or 'unknown'}): "
            f"the pod waits for a node labeled {label}={READY_VALUE} or"
            f" {'|'.join(v for v in NODE_LABEL_VALUES if v != READY_VALUE)} (its agent runs)"
        )
    res.warnings.extend(res.mismatches)
    res.ops = patch_ops(pod, new)
    res.pod = new if res.ops else pod
    return res


def apply_ops(body: dict[str, Any], ops: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Apply a JSON patch (RFC 6902) to a copy of `body`."""
    return jsonpatch.apply_patch(body, list(ops))
