"""torch.compile for an engine that restarts: the compiled forward survives the process.

After the weight cache, compiling is the largest step of a restarting engine that uses
`torch.compile` (docs/performance.md). Keeping only torch's cache directories
(`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`, which the webhook points at the cache's
per-node directory) saves Inductor's code generation, but Dynamo still traces the model's
bytecode and rebuilds its guards on every start: the second start's compile was only ~4.6x
faster than the first for the 8B shape. torch's AOT precompile (`torch.compile(fn,
fullgraph=True).aot_compile(...)`, `save_compiled_function` / `load_compiled_function`) skips
Dynamo too. That is what this module does for a causal LM's prefill forward:

    from weightcache.integrations.compile import compile_forward
    forward = compile_forward(model, {"input_ids": ids}, identity=checkpoint_identity)
    logits = forward(input_ids=ids)

- The artifact's name is a key over everything that decides what was compiled and for what:
  torch, transformers and Python versions, the model class and config, parameter dtypes and
  device (CUDA capability), the example inputs' shapes and dtypes, and the caller's model
  identity (the checkpoint's). A model update or another torch build names another file, so a
  stale artifact is never loaded for other weights or another build.
- Artifacts are code the process runs: they are read only from a directory owned by this uid
  and writable by nobody else, through a file owned by this uid (O_NOFOLLOW), and written
  atomically; anything else is a miss, never a load.
- Inputs whose shapes differ from the example's go through plain `torch.compile` (with the same
  persisted directories), as does everything when AOT compile is unavailable (older torch, a
  graph break, an unserialisable guard): the engine always gets a working forward, and
  `source`/`reason` say which path served it.
Where the artifacts go: `cache_dir`, else `$WEIGHTCACHE_COMPILE_DIR`, else
`$TORCHINDUCTOR_CACHE_DIR/weightcache-aot`; with none of them set, nothing is persisted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightcache.constants import ENV_COMPILE_DIR

log = logging.getLogger("weightcache.compile")

ENV_INDUCTOR_DIR = "TORCHINDUCTOR_CACHE_DIR"
KEY_SCHEMA = 1

SOURCES = ("aot_loaded", "aot_compiled", "dynamo")


def default_dir() -> Path | None:
    explicit = os.environ.get(ENV_COMPILE_DIR)
    if explicit:
        return Path(explicit)
    inductor = os.environ.get(ENV_INDUCTOR_DIR)
    return Path(inductor) / "weightcache-aot" if inductor else None


def model_identity(model_dir: str | os.PathLike) -> str:
    """The checkpoint's identity for the key: its config and every safetensors header (names,
    dtypes, shapes, offsets), as the cache's fingerprint reads them."""
    from weightcache.native.shared.checkpoint import open_checkpoint
    from weightcache.native.shared.fingerprint import checkpoint_hash

    path = Path(model_dir)
    config = path / "config.json"
    raw = config.read_bytes() if config.is_file() else b""
    return hashlib.sha256(raw + checkpoint_hash(open_checkpoint(path)).encode()).hexdigest()[:32]


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = "none"
    return out


def _device_of(model: nn.Module) -> dict[str, Any]:
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    info: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["name"] = torch.cuda.get_device_name(device)
    return info


def _config_of(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    to_dict = getattr(config, "to_diff_dict", None) or getattr(config, "to_dict", None)
    return to_dict() if to_dict else repr(config)


def _signature(example: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {name: [list(t.shape), str(t.dtype), t.device.type] for name, t in example.items()}


def artifact_key(model: nn.Module, example: Mapping[str, torch.Tensor],
                 identity: str | None) -> str:
    """What the artifact was compiled for; any difference names another file."""
    cls = type(model)
    doc = {
        "schema": KEY_SCHEMA,
        "versions": _versions(),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": _config_of(model),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "device": _device_of(model),
        "inputs": _signature(example),
        "identity": identity,
        "grad": torch.is_grad_enabled(),
    }
    raw = json.dumps(doc, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _private_dir(path: Path) -> bool:
    """Ours alone: a directory (not a link), owned by this uid, writable by no one else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _ensure_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return _private_dir(path)


def _read_artifact(path: Path) -> bytes | None:
    """The bytes of our own artifact, or None (absent, a link, foreign, writable by others)."""
    if not _private_dir(path.parent):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return None
        return fh.read()


def _save_artifact(compiled: Any, path: Path) -> None:
    """torch writes the file (its own format); we publish it under its name atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
    os.close(fd)
    try:
        compiled.save_compiled_function(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _logits(model: nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
    """The function compiled ahead of time: the model is an argument, so its weights are inputs
    of the graph (never baked into it)."""
    return model(**inputs, use_cache=False).logits


def _guard_filter() -> Callable[..., list[bool]]:
    """Keep the guards that serialise (tensor metadata, global state); the key covers the rest
    (model code and config), since ID_MATCH guards on the module cannot be saved."""
    compiler = torch.compiler
    for name in ("keep_portable_guards_unsafe", "skip_all_guards_unsafe"):
        fn = getattr(compiler, name, None)
        if fn is not None:
            return fn
    return lambda entries: [False for _ in entries]


class CompiledForward:
    """`forward(**inputs) -> logits`: the AOT function for the example's shapes, Dynamo else."""

    def __init__(self, model: nn.Module, example: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.signature = _signature(example)
        self.source = "dynamo"
        self.reason: str | None = None
        self.path: Path | None = None
        self._aot: Callable[..., torch.Tensor] | None = None
        self._dynamo: Callable[..., torch.Tensor] | None = None

    def _fallback(self) -> Callable[..., torch.Tensor]:
        if self._dynamo is None:
            self._dynamo = torch.compile(_logits)
        return self._dynamo

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        if self._aot is not None and _signature(inputs) == self.signature:
            return self._aot(self.model, **inputs)
        return self._fallback()(self.model, **inputs)


def _aot_compile(model: nn.Module, example: Mapping[str, torch.Tensor]) -> Any:
    config = getattr(torch._dynamo.config, "enable_aot_compile", None)
    patch = (torch._dynamo.config.patch(enable_aot_compile=True) if config is not None
             else contextlib.nullcontext())
    with patch:
        compiled = torch.compile(_logits, fullgraph=True,
                                 options={"guard_filter_fn": _guard_filter()})
        return compiled.aot_compile(((model,), dict(example)))


def compile_forward(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    *,
    identity: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    aot: bool = True,
) -> CompiledForward:
    """The model's compiled logits forward, loaded from the artifact when one was saved.

    `identity` names the weights (e.g. the checkpoint's fingerprint): part of the key.
    Compiling happens here (ahead of the first request), with the example inputs.
    """
    out = CompiledForward(model, example)
    directory = Path(cache_dir) if cache_dir is not None else default_dir()
    if not aot or not hasattr(torch.compiler, "load_compiled_function"):
        out.reason = "AOT compile off" if not aot else f"torch {torch.__version__} has no AOT"
        return out
    key = artifact_key(model, example, identity)
    path = directory / f"aot-{key}.bin" if directory is not None else None
    out.path = path
    if path is not None:
        data = _read_artifact(path)
        if data is not None:
            try:
                out._aot = torch.compiler.load_compiled_function(io.BytesIO(data))
                out.source = "aot_loaded"
                return out
            except Exception as exc:  # a corrupt or incompatible file: compile again
                out.reason = f"cannot load {path.name}: {type(exc).__name__}: {exc}"
                log.warning("weightcache compile: %s", out.reason)
    try:
        compiled = _aot_compile(model, example)
    except Exception as exc:
        out.reason = f"AOT compile failed, plain torch.compile: {type(exc).__name__}: {exc}"
        log.warning("weightcache compile: %s", out.reason)
        return out
    out._aot = compiled
    out.source = "aot_compiled"
    if path is not None and _ensure_dir(path.parent):
        try:
            _save_artifact(compiled, path)
        except Exception as exc:
            out.reason = f"cannot save {path.name}: {type(exc).__name__}: {exc}"
            log.warning("weightcache compile: %s", out.reason)
    elif path is not None:
        out.reason = f"{path.parent} is not a private directory: not saved"
    return out


__all__ = ["SOURCES", "CompiledForward", "artifact_key", "compile_forward", "default_dir",
           "model_identity"]
