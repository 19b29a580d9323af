"""`weightcache.client.from_pretrained`: a transformers model from the cache, identical to
transformers' own `from_pretrained`.

The checkpoints are written by transformers itself (`LlamaConfig`, `save_pretrained` with
safetensors and a small `max_shard_size`, so several shards plus the index), served by a real
`weightcache preload`, and compared with `AutoModelForCausalLM.from_pretrained` of the same
directory: every parameter and buffer (non-persistent rotary buffers included) and the
logits bit-equal, tied embeddings one Parameter. The rules encoded come from transformers 5's
`modeling_utils.py`: models are instantiated on meta (`get_init_context`), non-persistent
buffers are allocated on the target device and filled by `_init_weights`
(`_move_missing_keys_from_meta_to_device`, `_initialize_missing_keys`), then weights are tied
(`tie_weights`) and the model is put in eval mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from weightcache import client  # noqa: E402
from weightcache.client import from_pretrained, load_state_dict, materialize  # noqa: E402
from weightcache.testing.processes import Preload  # noqa: E402

from .conftest import private_dir  # noqa: E402

IDS = torch.tensor([[1, 17, 42, 7, 99, 3, 250, 11]])


def write_tiny_llama(path: Path, *, tied: bool, layers: int = 4) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied, dtype="bfloat16",
    )
    torch.manual_seed(1234 + tied)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    return path


@pytest.fixture(scope="module", params=["tied", "untied"])
def served_llama(request, tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    base = tmp_path_factory.mktemp(f"hf-{request.param}")
    model = write_tiny_llama(base / "model", tied=request.param == "tied")
    sockets = private_dir(base / "sockets")
    p = Preload(["--model", str(model), "--weight-cache-socket-dir", str(sockets)])
    try:
        p.wait_ready(120)
        yield model, sockets
    finally:
        p.stop()


def reference(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir)


def assert_identical(ours, ref) -> None:
    a, b = ref.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    ref_buffers = dict(ref.named_buffers())
    our_buffers = dict(ours.named_buffers())
    assert ref_buffers.keys() == our_buffers.keys()
    for name, buf in ref_buffers.items():  # non-persistent ones are not in state_dict()
        assert buf.dtype == our_buffers[name].dtype and torch.equal(buf, our_buffers[name]), name
    assert ours.training is False and ref.training is False
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, ref(IDS).logits)


def test_from_pretrained_is_identical_to_transformers(served_llama):
    model_dir, sockets = served_llama
    ours, result = from_pretrained(model_dir, socket_dir=sockets, fallback=False,
                                   return_result=True)
    assert result.source == "cache"
    ref = reference(model_dir)
    assert_identical(ours, ref)
    tied = ref.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is tied
    assert not any(p.is_meta for p in ours.parameters())
    assert all(b.device.type == "cpu" for b in ours.buffers())
    # zero_copy: the parameters are the mapped arena, not copies.
    up = "model.layers.0.mlp.up_proj.weight"
    assert ours.get_parameter(up).data_ptr() == result.state_dict[up].data_ptr()
    # The same tokens come out of generate() (generation config read from the directory).
    with torch.no_grad():
        a = ours.generate(IDS, max_new_tokens=4, do_sample=False)
        b = ref.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_from_pretrained_falls_back_to_disk_identically(served_llama, tmp_path):
    model_dir, _ = served_llama
    ours, result = from_pretrained(model_dir, socket_dir=private_dir(tmp_path / "none"),
                                   return_result=True)
    assert result.source == "disk" and "unavailable" in result.reason
    assert_identical(ours, reference(model_dir))


def test_strict_refuses_a_checkpoint_larger_than_the_model(served_llama):
    model_dir, sockets = served_llama
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 3  # a 3-layer model, a 4-layer checkpoint
    with pytest.raises(client.UnexpectedTensorError, match=r"model\.layers\.3\."):
        from_pretrained(model_dir, config=config, socket_dir=sockets, fallback=False)
    model = from_pretrained(model_dir, config=config, socket_dir=sockets, fallback=False,
                            strict=False)
    assert len(model.model.layers) == 3


def test_materialize_names_meta_non_persistent_buffers(served_llama):
    model_dir, sockets = served_llama
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = load_state_dict(model_dir, socket_dir=sockets, fallback=False)
    with pytest.raises(client.MissingTensorError, match=r"rotary_emb\.inv_freq.*non-persistent"):
        materialize(model, state)


def test_materialize_keeps_real_non_persistent_buffers(served_llama):
    """A module built with real buffers keeps their values (moved to the weights' device)."""
    model_dir, sockets = served_llama
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    before = model.model.rotary_emb.inv_freq.clone()
    state = load_state_dict(model_dir, socket_dir=sockets, fallback=False)
    materialize(model, state)
    assert torch.equal(model.model.rotary_emb.inv_freq, before)
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])


def test_a_hub_id_or_missing_config_is_refused_with_a_hint(tmp_path):
    with pytest.raises(client.CheckpointError, match="download"):
        from_pretrained("meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "auto"])
def test_an_explicit_dtype_equal_to_the_checkpoints_is_served_from_the_cache(served_llama, dtype):
    """The daemon runs with `auto` on a bf16 checkpoint: asking for bfloat16 by name or by
    torch dtype names the same bytes, so it is a cache hit (it was a `dtype` mismatch)."""
    model_dir, sockets = served_llama
    ours, result = from_pretrained(model_dir, socket_dir=sockets, fallback=False, dtype=dtype,
                                   return_result=True)
    assert result.source == "cache", result.reason
    assert_identical(ours, transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16))
