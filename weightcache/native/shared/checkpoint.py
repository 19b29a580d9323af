"""Reading a safetensors checkpoint directory's headers, strictly.

The daemon and the client both need the tensor table (names, dtypes, shapes, byte ranges)
before they touch any data: the daemon to size its arena, the client to compute the
fingerprint it sends. Headers are validated here once, so a corrupt file produces one clear
error naming the file instead of a crash halfway through loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .errors import WeightCacheError

INDEX_NAME = "model.safetensors.index.json"
# The limit safetensors itself enforces (MAX_HEADER_SIZE = 100_000_000 in
# safetensors/src/tensor.rs, huggingface/safetensors).
MAX_HEADER = 100_000_000
# Dimensions are usize in safetensors and int64 in torch: anything larger cannot be a tensor.
MAX_DIM = 2**63 - 1
# Nesting a header may need: {name: {"shape": [..]}} is depth 3; serde_json stops at 128.
MAX_JSON_DEPTH = 64

# safetensors dtype tag -> (torch dtype name, itemsize). Kept free of torch so that the
# launcher can validate a checkpoint without paying for importing it.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


class CheckpointError(ValueError, WeightCacheError):
    """The model directory is missing, empty, or holds an invalid safetensors file.

    A WeightCacheError too: the client's contract is that every failure of a load, the
    checkpoint's included, is one (a ValueError as before, for callers that catch that).
    """

    reason = "checkpoint"


class TensorInfo(NamedTuple):
    """One tensor of a file (a named tuple: built per tensor on every attach, so it must be
    cheap; immutable all the same)."""

    name: str
    tag: str  # safetensors dtype tag, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.tag][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.tag][1]

    @property
    def dtype(self) -> Any:
        """The torch dtype (imports torch on first use)."""
        import torch  # header parsing stays torch-free: the launcher validates without it

        return getattr(torch, self.dtype_name)


@dataclass
class Checkpoint:
    path: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # basename -> header
    config: dict[str, Any] | None = None
    # basename -> sha256 (hex) of the header's raw bytes, as read: what the fingerprint hashes
    # (the same bytes give the same digest on both sides without re-serialising the headers).
    header_digests: dict[str, str] = field(default_factory=dict)
    # sha256 (hex) of the index's and config.json's raw bytes (None: absent): with the header
    # digests, everything a rank's plan is made from (`plantable.plan_key`).
    index_digest: str | None = None
    config_digest: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _read_raw_header(path: Path) -> tuple[bytes, int]:
    """(raw header bytes, byte offset where the data section starts). Raises CheckpointError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors header (file is {size} bytes)")
            (hlen,) = struct.unpack("<Q", raw_len)
            if hlen > MAX_HEADER or hlen > size - 8:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header (declared header length {hlen},"
                    f" file is {size} bytes)"
                )
            raw = fh.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    return raw, 8 + hlen


def _header_object(raw: bytes, path: Path, *, depth_checked: bool = True) -> dict[str, Any]:
    header = _load_json(raw, f"{path}: corrupt safetensors header", depth_checked=depth_checked)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header map, byte offset where the data section starts). Raises CheckpointError."""
    raw, data_start = _read_raw_header(path)
    return _header_object(raw, path), data_start


def _depth_ok(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Nesting of a JSON text, counted without parsing it (brackets outside strings)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    depth, in_str, escaped = 0, False, False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _bracket_count(raw: bytes | str) -> int:
    if isinstance(raw, bytes):
        return raw.count(b"[") + raw.count(b"{")
    return raw.count("[") + raw.count("{")


def _load_json(raw: bytes | str, where: str, *, depth_checked: bool = True) -> Any:
    """Strict JSON like serde_json: UTF-8, no NaN/Infinity, bounded nesting.

    The nesting scan is a Python loop per character: it runs only when the text holds more
    brackets than the limit (a count in C). `depth_checked=False` leaves it to the caller,
    which knows how many brackets a valid document needs (`_parse_file`); anything deeper
    than Python's own recursion limit is a RecursionError either way."""
    try:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        if depth_checked and _bracket_count(raw) > MAX_JSON_DEPTH and not _depth_ok(raw):
            raise CheckpointError(f"{where} (JSON nested deeper than {MAX_JSON_DEPTH})")
        return json.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} (not UTF-8)") from None
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{where} (not JSON: {exc})") from None


def _parse_file(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo], str]:
    """Validate one file by safetensors' own rules (`Metadata::validate` and `read_metadata`
    in safetensors/src/tensor.rs): `__metadata__` maps strings to strings; every tensor has a
    known dtype, a shape of non-negative integers and two integer offsets whose span is
    exactly shape x itemsize; sorted by offset the tensors tile the data section from 0 with
    no gap and no overlap, and the last one ends exactly at the end of the file."""
    raw, data_start = _read_raw_header(path)
    header = _header_object(raw, path, depth_checked=False)
    data_len = os.path.getsize(path) - data_start
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    # Runs on every attach (client fingerprint) for hundreds of entries: the checks are
    # written out, and the error context is only formatted when an entry is bad.
    brackets = 1  # the least a valid header needs: the top object, then per entry below
    for name, entry in header.items():
        if name == "__metadata__":
            brackets += isinstance(entry, dict)
            if entry is not None and not (
                isinstance(entry, dict)
                and all(isinstance(v, str) for v in entry.values())
            ):
                raise CheckpointError(
                    f"{path}: corrupt safetensors header (__metadata__ must map strings"
                    " to strings)"
                )
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: tensor {name!r}: header entry is not an object")
        tag, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        kind = DTYPES.get(tag) if isinstance(tag, str) else None
        if kind is None:
            raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {_short(tag)}")
        nbytes = kind[1]
        good = type(shape) is list
        if good:
            for d in shape:  # JSON gives int or bool; bool is refused
                if type(d) is not int or not 0 <= d <= MAX_DIM:
                    good = False
                    break
                nbytes *= d
        if not good:
            raise CheckpointError(f"{path}: tensor {name!r}: bad shape {_short(shape)}")
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or type(offsets[0]) is not int
            or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CheckpointError(
                f"{path}: tensor {name!r}: bad data_offsets {_short(offsets)}"
                f" (data is {data_len} bytes)"
            )
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets cover {offsets[1] - offsets[0]} bytes,"
                f" shape {_short(shape)} of {tag} needs {_short(nbytes)}"
            )
        spans.append((offsets[0], offsets[1], name))
        tensors[name] = TensorInfo(name, tag, tuple(shape), path, data_start + offsets[0], nbytes)
    brackets += 3 * len(tensors)  # {..., "shape": [...], "data_offsets": [...]}
    # Every structural bracket is a raw byte (escapes inside strings are not), so a header
    # with no more brackets than the entries need has nothing nested anywhere else; only one
    # with extras (an unknown key, brackets in names) pays for the exact scan.
    if _bracket_count(raw) > brackets and not _depth_ok(raw):
        raise CheckpointError(
            f"{path}: corrupt safetensors header (JSON nested deeper than {MAX_JSON_DEPTH})")
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            what = "overlaps the tensor before it" if start < end else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {name!r} at byte {start} {what}")
        end = stop
    if end != data_len:
        raise CheckpointError(
            f"{path}: tensors cover {end} of {data_len} data bytes (trailing bytes)"
        )
    return header, tensors, hashlib.sha256(raw).hexdigest()


def _short(value: Any, limit: int = 80) -> str:
    """repr() of a header value, cut: a hostile header must not make a huge error line."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None, str | None]:
    """The checkpoint's files, the index's weight map and the digest of its raw bytes."""
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            raw = index.read_bytes()
            weight_map = _load_json(raw, f"{index}: not a valid safetensors index")["weight_map"]
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or "\0" in name:
                raise CheckpointError(f"{index}: file {name!r} is outside the model directory")
            if not (model_dir / name).is_file():
                raise CheckpointError(f"{index}: references missing file {name}")
        return [model_dir / n for n in names], weight_map, hashlib.sha256(raw).hexdigest()
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    return files, None, None


def _hub_id_hint(model_dir: str | os.PathLike) -> str:
    """A hint when the missing path reads like a Hugging Face model id (`org/name`)."""
    text = os.fspath(model_dir)
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):
        return (f" (it looks like a Hugging Face model id: a local directory is needed;"
                f" download it first, e.g. `hf download {text} --local-dir /models/{parts[1]}`)")
    return ""


def _pickle_hint(path: Path) -> str:
    """A hint when the directory holds only pickled PyTorch weights (never loaded here)."""
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
    if not pickled:
        return ""
    return (f" (it holds {pickled[0]}: convert the weights to safetensors first, e.g."
            " transformers' save_pretrained(dir, safe_serialization=True); pickled weights"
            " are never loaded, they can run code)")


def _model_files(model_dir: str | os.PathLike) -> tuple[Path, list[Path], dict[str, str] | None,
                                                    str | None]:
    """The directory checked, its files, the index's weight map and its raw digest."""
    path = Path(model_dir)
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist{_hub_id_hint(model_dir)}")
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory")
    files, weight_map, index_digest = _files(path)
    if not files:
        raise CheckpointError(
            f"model directory {path} contains no .safetensors files{_pickle_hint(path)}"
        )
    return path, files, weight_map, index_digest


def _config_bytes(path: Path) -> bytes | None:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        return cfg_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None


def open_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    path, files, weight_map, index_digest = _model_files(model_dir)
    tensors: dict[str, TensorInfo] = {}
    headers: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    for file in files:
        header, found, digests[file.name] = _parse_file(file)
        headers[file.name] = header
        for name, info in found.items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r} appears in both {tensors[name].file.name} and {file.name}"
                )
            tensors[name] = info
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors or tensors[name].file.name != fname:
                raise CheckpointError(f"{path / INDEX_NAME}: {name!r} is not in {fname}")
    config = None
    raw_config = _config_bytes(path)
    if raw_config is not None:
        loaded = _load_json(raw_config, f"{path / 'config.json'}: not valid JSON")
        config = loaded if isinstance(loaded, dict) else None
    return Checkpoint(path, files, dict(sorted(tensors.items())), headers, config, digests,
                      index_digest, _digest(raw_config))


def _digest(raw: bytes | None) -> str | None:
    return None if raw is None else hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class RawCheckpoint:
    """What a checkpoint's plan is made from, by digest, without parsing a header: the
    engine's first attach binds a plan the daemon ships to exactly these bytes."""

    path: Path
    files: list[Path]
    header_digests: dict[str, str]  # basename -> sha256 of the raw header, as Checkpoint's
    index_digest: str | None
    config_digest: str | None


def read_raw(model_dir: str | os.PathLike) -> RawCheckpoint:
    """The files (from the index or the directory, checked as `open_checkpoint` does) and the
    digests of their raw headers, the index and config.json. Raises CheckpointError.

    The headers are read and hashed, never parsed: a header `open_checkpoint` would refuse
    has a digest no daemon serves (a daemon refuses it at start), so it matches nothing."""
    path, files, _, index_digest = _model_files(model_dir)
    digests = {f.name: hashlib.sha256(_read_raw_header(f)[0]).hexdigest() for f in files}
    return RawCheckpoint(path, files, digests, index_digest, _digest(_config_bytes(path)))


def tied_aliases(ckpt: Checkpoint) -> dict[str, str]:
    """Aliases implied by `tie_word_embeddings` (Llama-family naming): alias -> target.

    The output projection shares storage with the input embedding; it is served once and
    re-established as an alias so the engine's parameters stay one object.
    """
    cfg = ckpt.config or {}
    if not cfg.get("tie_word_embeddings", False):
        return {}
    for target in ("model.embed_tokens.weight", "embed_tokens.weight"):
        if target in ckpt.tensors:
            alias = "lm_head.weight"
            if alias in ckpt.tensors:
                a, t = ckpt.tensors[alias], ckpt.tensors[target]
                if (a.tag, a.shape) != (t.tag, t.shape):
                    return {}
            return {alias: target}
    return {}
