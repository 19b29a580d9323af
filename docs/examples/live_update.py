"""A torch engine that keeps serving across an in-place update, CUDA graph included.

The engine attaches zero_copy to the local daemon, derives one tensor from the weights the way
post-load processing does (a fused QKV projection), and on CUDA captures one CUDA graph of its
forward pass. Then `weightcache update --model NEW` runs. During `begin` the engine stops
running the model (a ModelGate); on `finish` it refills the fused tensor IN PLACE (same
address, as vLLM's direct reload requires of post-load processing) and replays the very same
graph: the outputs are the new checkpoint's, without re-capture.

    python docs/examples/live_update.py --model OLD --new-model NEW --socket-dir DIR \
        [--device cuda]

prints one JSON line; tests/gpu/test_update_cuda.py and tests/native/test_update_example.py
run it. Exit 0 when the replayed (or, on CPU, eager) outputs equal a model built from NEW's
files and every weight kept its address.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightcache.client import ModelGate, attach, follow_updates

LAYER = "model.layers.0."


class TinyEngine:
    """Embedding -> fused QKV (derived) -> o_proj -> MLP -> norm -> tied head; static buffers."""

    def __init__(self, weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
        self.w = weights
        self.tokens = tokens  # static input (a captured graph reads this address)
        q, k, v = (weights[LAYER + f"self_attn.{n}_proj.weight"] for n in "qkv")
        self.qkv = torch.empty((q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]),
                               dtype=q.dtype, device=q.device)
        self.rederive()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def rederive(self) -> None:
        """Post-load processing, in place: the fused tensor keeps its address."""
        q, k, v = (self.w[LAYER + f"self_attn.{n}_proj.weight"] for n in "qkv")
        torch.cat([q, k, v], out=self.qkv)

    def forward(self) -> torch.Tensor:
        w = self.w

        def norm(x: torch.Tensor) -> torch.Tensor:  # RMS norm keeps random weights finite
            return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

        x = torch.nn.functional.embedding(self.tokens, w["model.embed_tokens.weight"])
        hidden = w[LAYER + "self_attn.q_proj.weight"].shape[0]
        qkv = norm(x) @ self.qkv.t()
        x = x + norm(qkv[..., :hidden] @ w[LAYER + "self_attn.o_proj.weight"].t())
        h = norm(x)
        gate = h @ w[LAYER + "mlp.gate_proj.weight"].t()
        up = h @ w[LAYER + "mlp.up_proj.weight"].t()
        x = x + norm((torch.nn.functional.silu(gate) * up) @ w[LAYER + "mlp.down_proj.weight"].t())
        x = norm(x) * w["model.norm.weight"]
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return (x @ head.t()).float()

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward()  # warm-up on a side stream, as torch's docs require
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.forward()

    def run(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            torch.cuda.synchronize()
            assert self.out is not None
            return self.out.clone()
        return self.forward()


def reference(model: Path, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(f), device=str(device)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--new-model", type=Path, required=True)
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    res = attach(args.model, device=device, socket_dir=args.socket_dir, mode="zero_copy",
                 fallback=False)
    tokens = torch.arange(8, device=device).view(1, 8)
    engine = TinyEngine(res.state_dict, tokens)
    if device.type == "cuda":
        engine.capture()
    before = engine.run()
    ptrs = {n: t.data_ptr() for n, t in res.state_dict.items()}
    derived_ptr = engine.qkv.data_ptr()
    gate = ModelGate()
    seen: list[tuple[int, bool]] = []

    def on_resume(generation: int, changed: bool) -> None:
        seen.append((generation, changed))
        if changed:
            engine.rederive()

    part = follow_updates(res, gate=gate, on_resume=on_resume)
    assert part is not None
    update = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "update", "--model", str(args.new_model),
         "--socket-dir", args.socket_dir], capture_output=True, text=True, check=False)
    part.wait_for("finish")
    part.close()
    with gate:  # what the engine's serving loop does around every step
        after = engine.run()
    fresh = TinyEngine(reference(args.new_model, device), tokens.clone())
    expected = fresh.forward()
    report = {
        "update": json.loads(update.stdout.strip().splitlines()[-1]) if update.stdout else None,
        "update_rc": update.returncode,
        "graph": engine.graph is not None,
        "addresses_kept": ptrs == {n: t.data_ptr() for n, t in res.state_dict.items()}
        and derived_ptr == engine.qkv.data_ptr(),
        "outputs_changed": not torch.equal(before, after),
        # Same kernels on the same bytes: equal up to bf16 rounding at most.
        "equals_new_model": bool(torch.allclose(after, expected, rtol=2e-2, atol=2e-2)),
        "differs_from_old": bool((after - before).abs().max() > 0.1),
        "max_abs_diff": float((after - expected).abs().max()),
        "resumed": seen,
    }
    print(json.dumps(report), flush=True)
    ok = (update.returncode == 0 and report["addresses_kept"] and report["outputs_changed"]
          and report["equals_new_model"] and report["differs_from_old"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
