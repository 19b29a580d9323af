"""The warmup directory of a cache on a node: its identity subdirectory and the environment
that points vLLM, FlashInfer, Triton and Inductor at it (docs/warmup.md).

One module for both sides: the agent computes the identity from its plan and sets the
variables for `vllm preload`, the webhook computes it from the WeightCache and sets them in
engine pods. Both must agree byte for byte, or the engine never finds what the daemon tuned.

Why these variables (vLLM 0.33, vllm/envs.py and flashinfer_autotune_cache.py):
- `VLLM_CACHE_ROOT`: torch.compile (incl. AOT and Inductor), the per-rank FlashInfer
  autotune tables (`flashinfer_autotune_cache/<flashinfer version>/<arch>/<config hash>/`),
  the startup plan. Ignored by vLLM's compile-cache key (`compile_factors`).
- `FLASHINFER_WORKSPACE_BASE`: FlashInfer's JIT kernels and its v2 autotune store (what a
  world-size-1 engine uses), otherwise under `$HOME/.cache/flashinfer`.
- `TRITON_CACHE_DIR`: Triton kernels compiled outside vLLM's compile regions (vLLM keeps a
  caller's value).
Not `VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`: it drops the version/arch level of the table path.
Not `HOME`/`XDG_CACHE_HOME`: they also move the Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from weightcache import constants
from weightcache.api.v1alpha1 import WeightCacheSpec

IDENTITY_HEX = 16
IDENTITY_RE = re.compile(rf"^[0-9a-f]{{{IDENTITY_HEX}}}$")
# Subdirectories of an identity directory, by what they hold (the status's `kind`s).
KINDS = ("vllm", "flashinfer", "triton", "inductor", "torch")
# What vLLM engines get and `vllm preload` gets (the same, so both resolve the same paths).
VLLM_VARS = {
    "VLLM_CACHE_ROOT": "vllm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TRITON_CACHE_DIR": "triton",
}
# What native / transformers engines get: torch's own caches and weightcache's helper dir.
TORCH_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    constants.ENV_COMPILE_DIR: "torch",
}
STARTUP_PLAN_VAR = "VLLM_ENABLE_STARTUP_PLAN"


def identity(spec: WeightCacheSpec, cache_uid: str) -> str:
    """The identity of what a cache compiles for: 16 hex of a canonical hash.

    It covers the cache object's uid (a re-created cache never reuses leftovers), the uid
    the files belong to (runAs.uid), the runtime, the served model (path, revision), the
    engine arguments, the launched layout and the image (vLLM, FlashInfer, torch builds).
    Not the epoch, node, ports or resources: they do not change what is compiled. `spec`
    must be valid (`operator.spec.validate`).
    """
    document = {"uid": cache_uid, "runAs": spec.run_as.uid, **compiled_for(spec)}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:IDENTITY_HEX]


def compiled_for(spec: WeightCacheSpec) -> dict[str, Any]:
    """What the compiled and tuned artifacts depend on, of a valid spec: the runtime, the
    image, the served model, the engine arguments and the launched layout (the identity
    without the cache object; also what two seed peers must share, contracts/seed.py)."""
    layout = spec.launched_layout()
    document: dict[str, Any] = {
        "runtime": spec.runtime,
        "image": spec.image,
        "model": {"path": spec.model.path, "revision": spec.model.revision},
        "engineArgs": spec.engine_args.to_dict(),
        "layout": {"tensor": layout.tensor, "data": layout.data, "nodes": layout.nodes,
                   "dataLocal": layout.data_local, "expert": layout.expert},
    }
    if spec.runtime == "native":
        document["device"] = spec.device_kind
    return document


def identity_dir(spec: WeightCacheSpec, cache_uid: str) -> str:
    """`<cacheDir>/<identity>` on the node."""
    return posixpath.join(str(spec.warmup.cache_dir), identity(spec, cache_uid))


def vllm_env(root: str) -> dict[str, str]:
    """The variables of `vllm preload` and of injected vLLM engines under identity dir `root`."""
    return {name: posixpath.join(root, sub) for name, sub in VLLM_VARS.items()}


def engine_env(spec: WeightCacheSpec, root: str) -> dict[str, str]:
    """What an injected engine of this cache gets (ordered: the webhook appends in order)."""
    if spec.runtime == "vllm":
        env = vllm_env(root)
        if spec.warmup.startup_plan:
            env[STARTUP_PLAN_VAR] = "1"
        return env
    return {name: posixpath.join(root, sub) for name, sub in TORCH_VARS.items()}
