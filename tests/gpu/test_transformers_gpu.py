"""`weightcache.client.from_pretrained` on a GPU at real shapes (marked `gpu`).

Llama-3.1-8B's shape (untied, 16 GB bf16) and Llama-3.2-1B's (tied), written by transformers
itself with `save_pretrained` (safetensors, 5 GB shards plus the index), served by a real
`weightcache preload --device cuda`, then built by our `from_pretrained(device="cuda:0")` and
by transformers' `AutoModelForCausalLM.from_pretrained(dir).to("cuda:0")`: the logits
must be bit-equal and the rotary buffers equal. `WEIGHTCACHE_GPU_HF_SHAPES` picks the shapes
(default "1b,8b").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from weightcache.client import from_pretrained  # noqa: E402
from weightcache.testing.processes import Preload  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               tie_word_embeddings=False),
}
WANTED = [s for s in os.environ.get("WEIGHTCACHE_GPU_HF_SHAPES", "1b,8b").split(",") if s]


@pytest.mark.parametrize("shape", WANTED)
def test_from_pretrained_logits_bit_equal_on_gpu(shape):
    work = Path(tempfile.mkdtemp(prefix="wc-hf-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    sockets = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))  # socket paths <= 107 bytes
    preload = None
    try:
        cfg = transformers.LlamaConfig(
            **SHAPES[shape], max_position_embeddings=8192, dtype="bfloat16"
        )
        torch.manual_seed(0)
        with torch.device("cuda:0"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(work, safe_serialization=True, max_shard_size="5GB")
        del model
        torch.cuda.empty_cache()
        preload = Preload(["--model", str(work), "--device", "cuda",
                           "--weight-cache-socket-dir", str(sockets)])
        preload.wait_ready(600)
        ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        ids = ids.to("cuda:0")
        ours, result = from_pretrained(work, device="cuda:0", socket_dir=sockets,
                                       fallback=False, return_result=True)
        assert result.source == "cache"
        print(f"{shape}: attach {result.seconds:.3f} s, {result.nbytes / 1e9:.2f} GB")
        with torch.no_grad():
            ours_logits = ours(ids).logits
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is cfg.tie_word_embeddings
        ours_inv = ours.model.rotary_emb.inv_freq.clone()
        assert ours_inv.device == torch.device("cuda", 0)
        del ours, result
        torch.cuda.empty_cache()
        # dtype=torch.bfloat16 names the same bytes as the daemon's `auto` on a bf16
        # checkpoint: served from the cache, mapping it (no new device memory for weights).
        before = torch.cuda.memory_allocated(0)
        same, result = from_pretrained(work, device="cuda:0", socket_dir=sockets,
                                       dtype=torch.bfloat16, fallback=False, return_result=True)
        assert result.source == "cache", result.reason
        extra = torch.cuda.memory_allocated(0) - before
        assert extra < 64 * 2**20, f"{extra / 1e9:.2f} GB allocated for a cached load"
        with torch.no_grad():
            assert torch.equal(same(ids).logits, ours_logits)
        del same, result
        torch.cuda.empty_cache()
        # No device_map: transformers would need accelerate for it. Loading on CPU and moving
        # gives the same bits (rotary buffers are computed on CPU either way).
        ref = transformers.AutoModelForCausalLM.from_pretrained(work).to("cuda:0")
        with torch.no_grad():
            ref_logits = ref(ids).logits
        assert torch.equal(ref.model.rotary_emb.inv_freq, ours_inv)
        assert torch.equal(ours_logits, ref_logits)
        print(f"{shape}: logits bit-equal to from_pretrained, transformers "
              f"{transformers.__version__}")
    finally:
        if preload is not None:
            preload.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
