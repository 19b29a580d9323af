"""A transformers model from a checkpoint directory, with its weights from the weight cache.

    from weightcache.client import from_pretrained
    model = from_pretrained("/models/llama", device="cuda:0")

does what `AutoModelForCausalLM.from_pretrained(dir, dtype=..., device_map=device)` does, in
the same order, except that the weights come from the local daemon (falling back to disk):

1. the model is instantiated on the meta device, as transformers 5 does (no memory, no init);
2. non-persistent buffers (rotary `inv_freq`, ...), which no checkpoint holds, are allocated on
   the target device and filled by the model's own `_init_weights`, as transformers'
   `_move_missing_keys_from_meta_to_device` + `_initialize_missing_keys` do. This runs while
   the parameters are still on meta, so the initialiser can never write into cached memory
   (with `zero_copy` that memory is shared with the daemon);
3. the cached tensors become the parameters (`materialize`, strict: a missing or unexpected
   tensor is an error); tensors whose dtype differs from the parameter's (a
   `_keep_in_fp32_modules` model) are cast, as transformers would;
4. tied weights stay one Parameter (the checkpoint alias and the model's own tie agree), the
   generation config is read, and the model is put in eval mode.

The result is bit-identical to `from_pretrained` (tests/native/test_transformers.py runs both
on a Llama written by transformers itself; tests/gpu/test_transformers_gpu.py on the 8B shape).
Tensor parallelism is vLLM's business: this builds one full (TP=1) model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightcache.native.engine.attach import (
    AttachResult,
    attach,
    materialize,
    non_persistent_buffers,
)
from weightcache.native.shared.checkpoint import CheckpointError

log = logging.getLogger("weightcache.transformers")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Checkpoint tensors transformers itself drops on load (old checkpoints kept them as buffers).
IGNORED_UNEXPECTED = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "weightcache.client.from_pretrained needs transformers: "
            "pip install 'weightcache[transformers]'"
        ) from None
    return transformers


def _resolve_dtype(config: Any, dtype: str | torch.dtype) -> tuple[torch.dtype, str]:
    """(torch dtype of the model, dtype the cache serves): "auto" is the checkpoint's own."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
        return dtype, names[dtype]
    if dtype == "auto":
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, str):
            configured = DTYPES.get(configured)
        return (configured if isinstance(configured, torch.dtype) else torch.float32), "auto"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype], dtype


def _init_non_persistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate the non-persistent buffers on `device` and let the model's initialiser fill them.

    `_init_weights(module)` is what transformers 5 calls for keys no checkpoint held; the
    parameters are still on meta here, so it touches nothing but these buffers.
    """
    names = non_persistent_buffers(model)
    owners: dict[int, nn.Module] = {}
    filled: dict[str, tuple[nn.Module, str]] = {}
    for name in names:
        prefix, _, attr = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        buf = owner._buffers[attr]
        if buf is not None and buf.device.type == "meta":
            # A sentinel, so a buffer the initialiser does not know is an error, not garbage.
            owner._buffers[attr] = torch.full(buf.shape, _sentinel(buf.dtype), dtype=buf.dtype,
                                              device=device)
            owners[id(owner)] = owner
            filled[name] = (owner, attr)
    init = getattr(model, "_init_weights", None)
    if owners and init is None:
        raise TypeError(f"{type(model).__name__} has no _init_weights to fill {names}")
    with torch.no_grad():
        for owner in owners.values():
            init(owner)
    left = [n for n, (owner, attr) in filled.items()
            if _untouched(owner._buffers[attr])]
    if left:
        raise TypeError(
            f"{type(model).__name__}._init_weights does not initialise the non-persistent"
            f" buffers {left}: build the model yourself and use weightcache.client.materialize"
        )


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _untouched(buf: torch.Tensor) -> bool:
    if buf.numel() == 0:
        return False
    if buf.dtype.is_floating_point or buf.dtype.is_complex:
        return bool(torch.isnan(buf).any())
    if buf.dtype == torch.bool:
        return False
    return bool((buf == torch.iinfo(buf.dtype).min).all())


def _cast_to_parameters(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Cast tensors whose dtype differs from the meta parameter's (transformers casts too)."""
    wanted = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    cast: dict[int, torch.Tensor] = {}
    for name, tensor in list(state.items()):
        dtype = wanted.get(name)
        if dtype is not None and tensor.dtype != dtype and tensor.is_floating_point():
            state[name] = cast.setdefault(id(tensor), tensor.to(dtype))
    if cast:
        log.info("weightcache: cast %d tensors to the model's parameter dtype", len(cast))


def from_pretrained(
    model_dir: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "auto",
    model_class: Any = None,
    config: Any = None,
    strict: bool = True,
    return_result: bool = False,
    **attach_options: Any,
) -> Any:
    """Build `model_class` (default: AutoModelForCausalLM's class for the config) from the cache.

    `model_dir` must be a local directory of safetensors files and a config.json.
    `attach_options` go to `weightcache.client.attach` (socket_dir, mode, fallback, timeouts).
    With `return_result` the `AttachResult` (source, reason, seconds) comes back too.
    """
    transformers = _import_transformers()
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{model_dir}: no config.json (a local transformers checkpoint directory is needed;"
            " download a hub model first, e.g. `hf download <id> --local-dir DIR`)"
        )
    if config is None:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    torch_dtype, served = _resolve_dtype(config, dtype)
    device = torch.device(device)
    if model_class is None:
        model_class = transformers.AutoModelForCausalLM
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, dtype=torch_dtype)
        else:
            model = model_class._from_config(config, dtype=torch_dtype)
    _init_non_persistent_buffers(model, device)
    result: AttachResult = attach(path, device=device, dtype=served, **attach_options)
    state = dict(result.state_dict)
    _cast_to_parameters(model, state)
    ignore = (*IGNORED_UNEXPECTED, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                     or ()))
    materialize(model, state, strict=strict, ignore_unexpected=tuple(ignore), device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    generation = path / "generation_config.json"
    if generation.is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = transformers.GenerationConfig.from_pretrained(
            str(path), local_files_only=True
        )
    model.eval()
    return (model, result) if return_result else model


__all__ = ["from_pretrained"]
