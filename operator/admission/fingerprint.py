"""What the engine's weight fingerprint will hold, compared with what the cache's daemons hold.

vLLM's `ipc_cache` loader maps the daemon's weights only when its `WeightCacheKey`
(vllm/model_executor/model_loader/weight_cache/protocol.py) equals the daemon's field by
field; any difference means a silent load from disk. The webhook sees the engine's command
line and the cache's spec, so it compares every key field both of them determine, resolved
the way vLLM resolves it (`EngineArgs` defaults, dtype aliases of `ModelConfig`), and
reports each difference with the field and both values. What it cannot resolve (an `auto`
dtype against an explicit one: vLLM reads the checkpoint's config.json, which the webhook
cannot) is said as "could not check", never as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightcache.operator import imageref
from weightcache.operator.admission.cacheview import CacheView
from weightcache.operator.admission.cmdline import Argv, flag_values, model_arg

# vllm/config/model.py `_STR_DTYPE_TO_TORCH_DTYPE`: the names `--dtype` accepts besides auto.
DTYPE_ALIASES = {
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
TAIL = "; the fingerprints differ and the engine falls back to loading from disk"


@dataclass(frozen=True)
class Difference:
    """One fingerprint field whose engine and cache values differ."""

    field: str  # WeightCacheKey's name for it
    engine: str
    cache: str
    container: str | None
    note: str = ""

    def __str__(self) -> str:
        return (
            f"fingerprint field {self.field}: container {self.container!r} has "
            f"{self.engine}, the cache holds {self.cache}{self.note or TAIL}"
        )


# (WeightCacheKey field, vLLM flags, vLLM's default) for fields the cache may set through
# engineArgs.extraArgs: the engine must pass the same value.
EXTRA_ARG_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("kv_cache_dtype", ("--kv-cache-dtype",), "auto"),
    ("expert_placement_strategy", ("--expert-placement-strategy",), "linear"),
    ("moe_backend", ("--moe-backend",), "auto"),
    ("linear_backend", ("--linear-backend",), "auto"),
)
EP_ON = ("--enable-expert-parallel", "-ep")
EP_OFF = ("--no-enable-expert-parallel",)


def canonical_dtype(value: str) -> str:
    """`half` -> `float16`, `float` -> `float32`; `auto` and unknown names unchanged."""
    return DTYPE_ALIASES.get(value.lower(), value.lower())


def last_flag(tokens: list[str], *names: str) -> str | None:
    values = flag_values(tokens, *names)
    return values[-1] if values else None


def expert_parallel(tokens: list[str]) -> bool:
    """vLLM's boolean flag: the last of `--enable-expert-parallel`/`-ep` and `--no-...` wins."""
    state = False
    for tok in tokens:
        key = tok.split("=", 1)[0].replace("_", "-")
        if key in EP_ON:
            state = True
        elif key in EP_OFF:
            state = False
    return state


def compare(container: dict, argv: Argv, cache: CacheView) -> tuple[list[Difference], list[str]]:
    """(differences, notes): fingerprint fields that differ, and what could not be checked."""
    name = container.get("name")
    diffs: list[Difference] = []
    notes: list[str] = []
    model = model_arg(argv.tokens)
    if model is not None and cache.model_path and model.rstrip("/") != cache.model_path.rstrip("/"):
        diffs.append(
            Difference(
                "checkpoint", repr(model), repr(cache.model_path), name,
                "; unless both hold the same checkpoint (vLLM hashes the safetensors headers) "
                "the fingerprints differ and the engine falls back to loading from disk",
            )
        )
    image = container.get("image")
    if cache.image and image and imageref.differ(image, cache.image):
        diffs.append(
            Difference(
                "vllm_version", f"image {image!r}", f"image {cache.image!r}", name,
                "; the fingerprint includes the vLLM version, so unless both images carry the "
                "same one the engine falls back to loading from disk",
            )
        )
    if argv.kind == "none":
        return diffs, notes
    tokens = argv.tokens
    tp = last_flag(tokens, "--tensor-parallel-size", "-tp") or "1"
    if tp != str(cache.tensor):
        diffs.append(Difference("tp_size", tp, str(cache.tensor), name))
    dtype = canonical_dtype(last_flag(tokens, "--dtype") or "auto")
    want = canonical_dtype(cache.dtype)
    if dtype != want:
        if "auto" in (dtype, want):
            notes.append(
                f"could not check the dtype: container {name!r} uses {dtype}, cache "
                f"{cache.name!r} uses {want}, and `auto` means the checkpoint's own dtype "
                f"(config.json), which the webhook cannot read; if they differ the engine "
                f"falls back to loading from disk"
            )
        else:
            diffs.append(Difference("dtype", dtype, want, name))
    for fld, flags, given in (
        ("quantization", ("--quantization", "-q"), cache.quantization),
        ("revision", ("--revision",), cache.revision),
    ):
        engine = last_flag(tokens, *flags)
        if (engine or None) != (given or None):
            diffs.append(Difference(fld, str(engine), str(given), name))
    ep = expert_parallel(tokens)
    if ep != cache.expert:
        diffs.append(Difference("enable_expert_parallel", str(ep), str(cache.expert), name))
    extra = list(cache.extra_args)  # one token per item (CRD)
    for fld, flags, default in EXTRA_ARG_FIELDS:
        engine = last_flag(tokens, *flags) or default
        held = last_flag(extra, *flags) or default
        if engine != held:
            diffs.append(Difference(fld, engine, held, name))
    return diffs, notes
