"""Small real checkpoints for tests, benchmarks and the demo: Llama-named safetensors files.

Tests make their own checkpoints (no model hub is reachable, and a fixture must be able to
vary shape, dtype and file count); writing them with safetensors' own `save_file` keeps the
files exactly what users have.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 1024
    layers: int = 8
    intermediate: int = 2816
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 4
    tied: bool = True

    def nbytes(self, itemsize: int = 2) -> int:
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        per_layer = (
            2 * self.hidden * self.hidden
            + 2 * kv * self.hidden
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden
        )
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * per_layer + embed + self.hidden) * itemsize


TINY = LlamaShape(hidden=64, layers=2, intermediate=128, vocab=256, heads=4, kv_heads=2)
DEMO = LlamaShape()


def write_llama_checkpoint(
    path: str | os.PathLike,
    shape: LlamaShape = TINY,
    *,
    dtype: str = "bfloat16",
    files: int = 2,
    seed: int = 0,
) -> Path:
    """A Llama-named safetensors checkpoint with random weights and a config.json."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(tdtype)

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(shape.vocab, shape.hidden)
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(shape.hidden, shape.hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv, shape.hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv, shape.hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(shape.hidden, shape.hidden)
        tensors[p + "mlp.gate_proj.weight"] = rand(shape.intermediate, shape.hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(shape.intermediate, shape.hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(shape.hidden, shape.intermediate)
        tensors[p + "input_layernorm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
    tensors["model.norm.weight"] = torch.ones(shape.hidden, dtype=tdtype)
    if not shape.tied:
        tensors["lm_head.weight"] = rand(shape.vocab, shape.hidden)

    names = list(tensors)
    files = max(1, min(files, len(names)))
    per = -(-len(names) // files)
    weight_map: dict[str, str] = {}
    for n in range(files):
        chunk = names[n * per : (n + 1) * per]
        if not chunk:
            continue
        fname = (
            "model.safetensors" if files == 1 else f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        )
        save_file({k: tensors[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, fname))
    if files > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def sync_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)




Spec = tuple[str, list[int]]  # a bf16 tensor's name and shape


def write_bf16_files(
    path: str | os.PathLike,
    shards: list[list[Spec]],
    *,
    config: dict[str, Any],
    data: Callable[[BinaryIO, list[Spec]], None] | None = None,
    index: bool | None = None,
    fresh: bool = True,
) -> int:
    """bf16 safetensors files, one per shard (+ the index where `index`, by default when
    there are several), and config.json; the data bytes of `data(fh, shard)`, or a hole.

    A hole reads as zeros without any I/O: attach and planning benchmarks depend on the table
    and the mapping, not on the values, so a 16 GB or 64 GB shard takes no time or disk to
    write. The one header writer of the benchmarks (attach, load, gpu). Returns the data
    bytes written (or left as holes)."""
    out = Path(path)
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    index = len(shards) > 1 if index is None else index
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        fname = (f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if index
                 else "model.safetensors")
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            n = 2 * math.prod(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        with open(out / fname, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            if data is None:
                fh.truncate(8 + len(raw) + offset)
            else:
                data(fh, shard)
                fh.flush()
                os.fsync(fh.fileno())
        total += offset
    if index:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    return total


def split_specs(specs: list[Spec], files: int) -> list[list[Spec]]:
    """`specs` in `files` runs of (nearly) equal count."""
    per = -(-len(specs) // files)
    return [specs[k * per:(k + 1) * per] for k in range(files)]
