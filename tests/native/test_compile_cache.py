"""A restarting engine's compile hits the per-cache compile directory (integrations/compile.py).

Fresh interpreters, as restarted engine pods, with the environment the webhook gives a native or
transformers engine (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR` under one private directory).
What is asserted is torch's own bookkeeping (`torch._dynamo.utils.counters`), never time:
- plain `torch.compile`: the second start hits the FX graph / AOTAutograd caches of the dir, and
  Dynamo still traces the model;
- AOT: the first start compiles (Dynamo traces a graph) and saves; the next start loads the
  artifact and no Dynamo frame is traced at all;
- an artifact another uid could write is never loaded (it compiles again); other weights,
  shapes, config or dtype name another artifact (the key test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

CHILD = r"""
import json, os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from weightcache.integrations.compile import compile_forward
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    fwd = compile_forward(model, {"input_ids": ids}, identity=sys.argv[1], aot=sys.argv[2] == "aot")
    got = fwd(input_ids=ids)
    want = model(input_ids=ids, use_cache=False).logits
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({"source": fwd.source, "reason": fwd.reason,
    "path": str(fwd.path) if fwd.path else None, "same": bool(torch.allclose(got, want, atol=1e-5)),
    "counters": {g: dict(counters[g]) for g in ("inductor", "aot_autograd", "stats")}}))
"""


def start(tmp: Path, identity: str, mode: str = "aot") -> dict:
    root = tmp / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
           "TRITON_CACHE_DIR": str(root / "triton"), "PYTHONUNBUFFERED": "1"}
    env.pop("WEIGHTCACHE_COMPILE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CHILD, identity, mode], capture_output=True,
                         text=True, env=env, timeout=600, cwd=tmp)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_second_start_hits_the_cache_dir_and_loads_the_compiled_forward(tmp_path: Path) -> None:
    # Plain torch.compile with only the directories kept: Inductor's own caches hit, but
    # Dynamo still traces on every start (what AOT removes below).
    cold = start(tmp_path, "model-a", mode="dirs")
    assert cold["source"] == "dynamo" and cold["same"]
    assert cold["counters"]["aot_autograd"].get("autograd_cache_miss", 0) >= 1
    warm = start(tmp_path, "model-a", mode="dirs")
    assert warm["counters"]["aot_autograd"].get("autograd_cache_hit", 0) >= 1
    assert warm["counters"]["aot_autograd"].get("autograd_cache_miss", 0) == 0
    assert warm["counters"]["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert warm["counters"]["stats"].get("unique_graphs") == 1  # traced again

    first = start(tmp_path, "model-a")
    assert first["source"] == "aot_compiled", first["reason"]
    assert first["same"]
    assert first["counters"]["stats"].get("unique_graphs") == 1  # Dynamo traced the model
    artifact = Path(first["path"])
    assert artifact.is_file() and artifact.parent == tmp_path / "cache/inductor/weightcache-aot"
    assert artifact.stat().st_mode & 0o077 == 0

    second = start(tmp_path, "model-a")
    assert second["source"] == "aot_loaded" and second["path"] == first["path"]
    assert second["same"]
    assert second["counters"]["stats"].get("unique_graphs", 0) == 0  # nothing traced
    assert second["counters"]["aot_autograd"].get("autograd_cache_miss", 0) == 0

    # An artifact another uid could have written is not code we run: compiled again.
    os.chmod(artifact, 0o666)
    again = start(tmp_path, "model-a")
    assert again["source"] == "aot_compiled"


def test_the_key_names_weights_shapes_config_and_versions() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from weightcache.integrations.compile import artifact_key

    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        deeper = LlamaForCausalLM(LlamaConfig(**{**cfg, "num_hidden_layers": 2}))
    ids = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    key = artifact_key(model, ids, "a")
    assert key == artifact_key(model, ids, "a")
    assert key != artifact_key(model, ids, "b")  # other weights
    assert key != artifact_key(model, {"input_ids": torch.zeros(1, 9, dtype=torch.long)}, "a")
    assert key != artifact_key(deeper, ids, "a")  # other config
    assert key != artifact_key(model.to(torch.bfloat16), ids, "a")  # other dtype
