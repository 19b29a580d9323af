"""GPU section `restart`: a real engine (transformers Llama) restarting, phase by phase.

Each restart is a fresh interpreter, like a restarted engine pod. It times, from the moment
the parent spawned it: interpreter start, `import torch`, `import transformers`, the CUDA
context, building `LlamaForCausalLM` from its config on the meta device, the weights, and
the first forward pass to logits. Weights come from one of:
- `cache`: `weightcache.client.attach` (zero copy from the running daemon) + `materialize`;
- `disk`: safetensors `load_file(device="cuda")` per file + `materialize` (page cache warm
  or dropped);
- `from_pretrained`: transformers' own `from_pretrained(device_map="cuda")`, which builds
  the model and loads the weights in one step (its time is reported under weights).
Run by `weightcache bench --device cuda load` on the checkpoint it wrote; here only the child
side and the parent's spawn helper live.
"""

from __future__ import annotations

import time

_T_MODULE = time.time()  # as early as this module allows: after the interpreter's start

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES = ("interpreter", "import_torch", "import_transformers", "cuda_context",
          "build_on_meta", "weights", "first_forward")


def _fix_meta_buffers(model: Any, device: str) -> None:
    """Buffers the checkpoint does not hold (rotary inv_freq) are rebuilt on the device."""
    import torch

    for module in model.modules():
        bufs = getattr(module, "_buffers", {})
        if any(b is not None and b.is_meta for b in bufs.values()):
            if hasattr(module, "rope_init_fn") or "inv_freq" in bufs:
                fresh = type(module)(config=model.config, device=device)
                for name, value in fresh._buffers.items():
                    module._buffers[name] = value
                for key in ("attention_scaling",):
                    if hasattr(fresh, key):
                        setattr(module, key, getattr(fresh, key))
            else:
                for name, b in list(bufs.items()):
                    if b is not None and b.is_meta:
                        bufs[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def child(source: str, model_dir: str, sock: str | None, spawned: float) -> dict[str, Any]:
    marks: dict[str, float] = {"interpreter": _T_MODULE - spawned}
    t = time.time()

    def step(name: str) -> None:
        nonlocal t
        now = time.time()
        marks[name] = now - t
        t = now

    import torch

    step("import_torch")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    step("import_transformers")
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda").fill_(0)
    torch.cuda.synchronize()
    step("cuda_context")
    info: dict[str, Any] = {"source": source}
    if source == "from_pretrained":
        marks["build_on_meta"] = 0.0
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     device_map="cuda")
        torch.cuda.synchronize()
        step("weights")
    else:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        step("build_on_meta")
        from weightcache.native.engine.attach import attach, materialize

        if source == "cache":
            res = attach(model_dir, device="cuda:0", socket_path=sock, fallback=False)
            state = res.state_dict
            info["attach_seconds"] = round(res.seconds, 4)
        else:
            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                state.update(load_file(str(f), device="cuda:0"))
        materialize(model, state, strict=False)
        _fix_meta_buffers(model, "cuda")
        torch.cuda.synchronize()
        step("weights")
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 32), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    torch.cuda.synchronize()
    step("first_forward")
    info["logits_finite"] = bool(torch.isfinite(logits.float()).all().item())
    info["logits_checksum"] = round(float(logits.float()[0, -1, :64].sum().item()), 3)
    info["phases"] = {k: round(v, 4) for k, v in marks.items()}
    info["total_seconds"] = round(time.time() - spawned, 3)
    info["transformers"] = transformers.__version__
    return info


def spawn(source: str, model_dir: Path, sock: str | None, timeout: float = 240) -> dict:
    """One restart in a fresh interpreter; its phases as seen by the child."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    spawned = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.bench.restart", source, str(model_dir),
         sock or "-", repr(spawned)],
        capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.time() - spawned
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["wall_seconds"] = round(wall, 3)
            return out
    return {"source": source, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("cache", "disk", "from_pretrained"):
        source, model_dir, sock, spawned = argv[:4]
        result = child(source, model_dir, None if sock == "-" else sock, float(spawned))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    print("  the restart figures are part of the `load` section (it owns the checkpoint)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
