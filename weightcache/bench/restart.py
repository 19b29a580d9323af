"""Section `restart`: a real engine (transformers Llama) restarting, phase by phase.

Each restart is a fresh interpreter, like a restarted engine pod. It times, from the moment
the parent spawned it: interpreter start, `import torch`, `import transformers`, the CUDA
context, building `LlamaForCausalLM` from its config on the meta device, the weights,
`torch.compile` (when on) and the first forward pass to logits. Weights come from one of:
- `cache`: `weightcache.client.attach` (zero copy from the running daemon) + `materialize`;
- `cache_wait`: the same through the socket directory while the daemon may still be loading
  (the client waits for it: a fresh node, `engine/loading.py`);
- `disk`: safetensors `load_file` per file + `materialize` (page cache warm or dropped);
- `from_pretrained`: transformers' own `from_pretrained(device_map=device)`, which builds
  the model and loads the weights in one step (its time is reported under weights).
Compile (`WEIGHTCACHE_BENCH_RESTART_COMPILE`): `none`; `dirs` = plain `torch.compile` with
`TORCHINDUCTOR_CACHE_DIR`/`TRITON_CACHE_DIR` kept between starts; `aot` = the product helper
`weightcache.integrations.compile.compile_forward` (AOT precompile saved beside them). Its
`compile` phase is the compile (or artifact load) plus the first compiled forward.

`weightcache bench [--device cuda] restart` runs, on one checkpoint and in one run:
1. restart-compile: weights from the cache, compile none / dirs (empty dir, then the same dir)
   / aot (empty dir, then the same dir), with torch's own cache counters per start;
2. fresh node: the daemon and the engine started at the same moment (the engine's imports
   overlap the daemon's load, it attaches when its rank binds), against the engine alone from
   disk (`disk`, `from_pretrained`) and against today's order (READY first, then the engine),
   page cache dropped before each; the daemon as a node's first start (no import set of its
   own, the agent image's seed);
3. `holdab` (not by default): the fresh node's cache path with the disk share as it is and as
   it was before its growing hold and its look at others' reads, in turn (`hold_ab`).
On CUDA the checkpoint is the Llama-3.1-8B shape (WEIGHTCACHE_BENCH_RESTART_MODEL=8b|1b);
on CPU a small Llama; `--smoke` the tiniest. JSON: WEIGHTCACHE_BENCH_RESTART_OUT.
The `load` section runs the compile-free restarts too (`restart_figures`).
"""

from __future__ import annotations

import time

_T_MODULE = time.time()  # as early as this module allows: after the interpreter's start

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES = ("interpreter", "import_torch", "import_transformers", "cuda_context",
          "build_on_meta", "weights", "first_gemm", "compile", "first_forward", "second_forward")


ENV_DEVICE = "WEIGHTCACHE_BENCH_RESTART_DEVICE"
ENV_COMPILE = "WEIGHTCACHE_BENCH_RESTART_COMPILE"
COMPILE_MODES = ("none", "dirs", "aot")
SOURCES = ("cache", "cache_wait", "disk", "from_pretrained")
IMPORT_PHASES = ("import_torch", "import_transformers")  # an engine start's imports


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _compile_counters() -> dict[str, Any]:
    """torch's own cache counters and its slowest compile steps in this process."""
    from torch._dynamo.utils import counters

    keep: dict[str, Any] = {}
    for group in ("inductor", "aot_autograd", "stats", "dynamo_cache"):
        for k, v in counters.get(group, {}).items():
            if any(w in k for w in ("cache", "hit", "miss", "unique_graphs", "calls_captured")):
                keep[f"{group}.{k}"] = v
    try:
        from torch._dynamo.utils import compilation_time_metrics as ctm

        top = sorted(((k, round(sum(v), 3)) for k, v in ctm.items()), key=lambda kv: -kv[1])[:6]
    except Exception:  # a private table: its absence must not lose the run
        top = []
    return {"counters": keep, "slowest": top}


def _schedstat() -> tuple[float, float] | None:
    """This thread's seconds on a CPU and waiting for one (proc_pid_schedstat(5)); None where
    the kernel keeps no such count (it reads `0 0 n` while sched_info is off)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            on_cpu, waiting, _ = fh.read().split()
    except (OSError, ValueError):
        return None
    return (int(on_cpu) / 1e9, int(waiting) / 1e9) if int(on_cpu) else None


def _use() -> dict[str, Any]:
    """What the main thread and the process had used so far: CPU seconds, the seconds waiting
    for a CPU, major page faults and bytes read from the disk."""
    import resource

    from weightcache.native.shared.diskshare import read_own_reads

    sched = _schedstat()
    return {"cpu": time.thread_time(), "process_cpu": time.process_time(),
            "runqueue": sched[1] if sched else None,
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
            "read_bytes": read_own_reads()}


def _phase_use(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """One phase's use, and `off_cpu_s`: the main thread's wall time neither on a CPU nor (where
    counted) waiting for one: blocked, mostly on the disk (its faults and reads)."""
    d = {k: (after[k] - before[k] if None not in (after[k], before[k]) else None)
         for k in after}
    off = wall - d["cpu"] - (d["runqueue"] or 0.0)
    return {"cpu_s": round(d["cpu"], 4), "process_cpu_s": round(d["process_cpu"], 4),
            "runqueue_s": None if d["runqueue"] is None else round(d["runqueue"], 4),
            "off_cpu_s": round(max(off, 0.0), 4), "major_faults": d["major_faults"],
            "read_mb": None if d["read_bytes"] is None else round(d["read_bytes"] / 1e6, 2)}


def child(source: str, model_dir: str, sock: str | None, spawned: float) -> dict[str, Any]:
    device = os.environ.get(ENV_DEVICE, "cuda")
    compile_mode = os.environ.get(ENV_COMPILE, "none")
    marks: dict[str, float] = {"interpreter": _T_MODULE - spawned}
    # Why a phase took longer beside a loading daemon than alone (a fresh node's engine
    # imports 1.30-1.62x as long, runs 81-84): more CPU work, a wait for a CPU, or a wait on
    # the disk. Each phase's use says which.
    use: dict[str, dict[str, Any]] = {}
    last = _use()
    t = time.time()

    def step(name: str) -> None:
        nonlocal t, last
        now, used = time.time(), _use()
        marks[name] = now - t
        use[name] = _phase_use(last, used, now - t)
        t, last = now, used

    import torch

    step("import_torch")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    step("import_transformers")
    dev = "cuda:0" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda").fill_(0)
        torch.cuda.synchronize()
    step("cuda_context")
    info: dict[str, Any] = {"source": source, "compile": compile_mode, "device": device}
    if source == "from_pretrained":
        marks["build_on_meta"] = 0.0
        model = AutoModelForCausalLM.from_pretrained(  # a CPU device map needs accelerate
            model_dir, dtype=torch.bfloat16, device_map=dev if device == "cuda" else None)
        _sync(torch, device)
        step("weights")
    else:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        from weightcache.integrations.transformers import _init_non_persistent_buffers

        # Rotary inv_freq & co. (no checkpoint holds them), as `weightcache.client.from_pretrained`.
        _init_non_persistent_buffers(model, torch.device(dev))
        step("build_on_meta")
        from weightcache.native.engine.attach import attach, materialize

        if source in ("cache", "cache_wait"):
            where = ({"socket_path": sock, "fallback": False} if source == "cache"
                     else {"socket_dir": sock, "fallback": True})
            res = attach(model_dir, device=dev, **where)
            state = res.state_dict
            info["attach_seconds"] = round(res.seconds, 4)
            info["weights_from"], info["reason"] = res.source, res.reason
        else:
            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                state.update(load_file(str(f), device=dev))
        materialize(model, state, strict=False)
        _sync(torch, device)
        step("weights")
    model.eval()
    # The first matrix product of the process on its own: the GEMM library's handle and the
    # kernels it loads on first use. A fresh node's first forward took 0.5-1.1 s longer on the
    # overlapped cache path than on the others in 6 of 7 runs; this says whether that is there.
    a = torch.ones(64, 64, dtype=torch.bfloat16, device=dev)
    torch.matmul(a, a)
    _sync(torch, device)
    step("first_gemm")
    ids = torch.randint(0, model.config.vocab_size, (1, 32), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))
    with torch.no_grad():
        if compile_mode == "none":
            logits = model(input_ids=ids, use_cache=False).logits
            _sync(torch, device)
            step("first_forward")
            forward = lambda **kw: model(**kw, use_cache=False).logits  # noqa: E731
        else:
            from weightcache.integrations.compile import compile_forward, model_identity

            forward = compile_forward(model, {"input_ids": ids},
                                      identity=model_identity(model_dir),
                                      aot=compile_mode == "aot")
            logits = forward(input_ids=ids)
            _sync(torch, device)
            step("compile")
            info["compiled"] = {"source": forward.source, "reason": forward.reason}
        forward(input_ids=ids)
        _sync(torch, device)
        step("second_forward")
    if compile_mode != "none":
        info["compiled"].update(_compile_counters())
    info["logits_finite"] = bool(torch.isfinite(logits.float()).all().item())
    info["logits_checksum"] = round(float(logits.float()[0, -1, :64].sum().item()), 3)
    info["phases"] = {k: round(v, 4) for k, v in marks.items()}
    info["phase_use"] = use
    # Time to first logits: everything but the steady-state second forward.
    info["first_logits_seconds"] = round(sum(v for k, v in marks.items()
                                             if k != "second_forward"), 3)
    info["total_seconds"] = round(time.time() - spawned, 3)
    info["torch"] = torch.__version__
    info["transformers"] = transformers.__version__
    return info


def _child_env(device: str, compile_mode: str, cache_dir: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           ENV_DEVICE: device, ENV_COMPILE: compile_mode}
    if cache_dir is not None:  # what the webhook injects: one private directory per cache
        for sub in ("inductor", "triton"):
            (cache_dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    return env


def _result(proc_out: str, proc_err: str, code: int | None, source: str, wall: float) -> dict:
    for line in proc_out.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["wall_seconds"] = round(wall, 3)
            return out
    return {"source": source, "error": f"exit {code}: {proc_err[-2000:]}"}


def start(source: str, model_dir: Path, sock: str | None, *, device: str = "cuda",
          compile_mode: str = "none", cache_dir: Path | None = None,
          spawned: float | None = None) -> tuple[subprocess.Popen, float]:
    """One restart in a fresh interpreter, not waited for (the fresh-node part runs it beside
    a starting daemon)."""
    spawned = time.time() if spawned is None else spawned
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.bench.restart", source, str(model_dir),
         sock or "-", repr(spawned)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_child_env(device, compile_mode, cache_dir))
    return proc, spawned


def finish(proc: subprocess.Popen, spawned: float, source: str, timeout: float = 300) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return _result(out, err, proc.returncode, source, time.time() - spawned)


def spawn(source: str, model_dir: Path, sock: str | None, timeout: float = 300,
          **options: Any) -> dict:
    """One restart in a fresh interpreter; its phases as seen by the child."""
    proc, spawned = start(source, model_dir, sock, **options)
    return finish(proc, spawned, source, timeout)


# -- the section ----------------------------------------------------------------------------
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def write_checkpoint(path: Path, device: str, shape: str) -> dict[str, Any]:
    from weightcache.bench import load

    t0 = time.perf_counter()
    if device == "cuda":
        model = load.build_model() if shape == "8b" else _small_model("cuda", LLAMA_1B)
        info = load.write_layout(model, "sharded", path, None)
        del model
        import torch

        torch.cuda.empty_cache()
        return info
    model = _small_model("cpu", TINY if shape == "tiny" else SMALL)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    del model
    files = sorted(path.glob("*.safetensors"))
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "write_seconds": round(time.perf_counter() - t0, 2)}


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True)


def _small_model(device: str, shape: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    return model


def _phase(r: dict, name: str) -> float | None:
    return (r.get("phases") or {}).get(name)


def restart_compile(model: Path, device: str, work: Path, *, smoke: bool) -> dict[str, Any]:
    """Weights from the cache; compile none, dirs (first, second start), aot (first, second)."""
    from weightcache.bench.load import Launcher

    sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
    os.chmod(sockdir, 0o700)
    out: dict[str, Any] = {}
    launcher = Launcher(model, sockdir, device=device)
    try:
        sock = launcher.socket
        dirs, aot = work / "compile-dirs", work / ("compile-dirs" if smoke else "compile-aot")
        for label, mode, cdir in (("none", "none", None), ("dirs_first", "dirs", dirs),
                                  ("dirs_second", "dirs", dirs), ("aot_first", "aot", aot),
                                  ("aot_second", "aot", aot)):
            out[label] = spawn("cache", model, sock, device=device, compile_mode=mode,
                               cache_dir=cdir, timeout=400)
            log(f"  restart-compile {label} {json.dumps(out[label])[:600]}")
    finally:
        launcher.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
    s: dict[str, Any] = {}
    for label, r in out.items():
        s[f"{label}_compile_s"] = _phase(r, "compile")
        s[f"{label}_first_logits_s"] = r.get("first_logits_seconds")
    for kind in ("dirs", "aot"):
        first, second = s.get(f"{kind}_first_compile_s"), s.get(f"{kind}_second_compile_s")
        if first and second:
            s[f"{kind}_second_vs_first_compile"] = round(first / second, 2)
    first, best = s.get("dirs_first_compile_s"), s.get("aot_second_compile_s")
    if first and best:  # a plain first start against the product's second start
        s["aot_second_vs_dirs_first_compile"] = round(first / best, 2)
    out["summary"] = s
    return out


def _first_start_env(work: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The daemon's environment on a node new to the model (`work`, a new directory): no
    import set of its own (a path with nothing there yet), and the agent image's seed
    (`load.record_seed`). Before the seed (2a62591) these runs found the set an earlier start
    of the same run had written."""
    from weightcache.bench.load import record_seed

    seed = work / "import-set.seed.json"
    recorded = record_seed(seed)
    return ({"WEIGHTCACHE_IMPORT_SET": str(work / "node-import-set.json"),
             "WEIGHTCACHE_IMPORT_SET_SEED": str(seed)}, recorded)


def overlapped(model: Path, device: str, env: dict[str, str]) -> dict[str, Any]:
    """The cache path on a fresh node: every cache dropped, the daemon (`env` on top of this
    process's environment) and the engine started at the same moment; the engine's result,
    with when the daemon was READY and how its load shared the disk (`daemon_disk`)."""
    from weightcache.bench import gpu as g
    from weightcache.bench.load import drop

    Path(env["WEIGHTCACHE_IMPORT_SET"]).unlink(missing_ok=True)  # a first start each time
    sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
    os.chmod(sockdir, 0o700)
    drop(sorted(model.glob("*.safetensors")))
    t0 = time.time()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(model), "--device",
         device, "--weight-cache-socket-dir", str(sockdir)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env})
    proc, _ = start("cache_wait", model, str(sockdir), device=device, spawned=t0)
    try:
        ready = g.first_json_line(daemon, "READY ")
        ready_s = time.time() - t0
        r = finish(proc, t0, "cache_wait")
        rank = ((ready or {}).get("rank_loads") or [{}])[0]
        r["daemon_ready_s"] = round(ready_s, 3)
        r["daemon_ready"] = bool(ready)
        r["daemon_import_prefetch"] = rank.get("import_prefetch")
        r["daemon_disk"] = (rank.get("loader") or {}).get("disk")
    finally:
        g.stop_process(daemon)
        shutil.rmtree(sockdir, ignore_errors=True)
    return r


def hold_ab(model: Path, device: str, rounds: int = 2) -> dict[str, Any]:
    """The cache path on a fresh node with the disk share as it is (a growing hold after
    another program's faults, and others' reads seen: diskshare.HOLD_MAX, READ_FLOOR) and as
    it was before (a fixed hold, faults only; or the share `WEIGHTCACHE_BENCH_SHARE_BEFORE`
    names: load.share_before), in turn, `rounds` times: first logits, the daemon's READY, the
    engine's imports and the daemon's gentle seconds."""
    from weightcache.bench.load import SHARE_BEFORE_ENV, share_before

    work = Path(tempfile.mkdtemp(prefix="wc-fresh-node-"))
    env, seed = _first_start_env(work)
    out: dict[str, Any] = {"seed": seed}
    shares = {"default": {}, "before": share_before()}
    if os.environ.get(SHARE_BEFORE_ENV):
        out["before_env"] = shares["before"]
    try:
        for n in range(rounds):
            for label, extra in shares.items():
                key = f"{label}_{n + 1}"
                out[key] = overlapped(model, device, {**env, **extra})
                log(f"  hold-ab {key} {json.dumps(out[key])[:600]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s: dict[str, Any] = {}
    for key, r in out.items():
        if key in ("seed", "before_env"):
            continue
        disk = r.get("daemon_disk") or {}
        s[key] = {"first_logits_s": r.get("first_logits_seconds"),
                  "daemon_ready_s": r.get("daemon_ready_s"),
                  "engine_imports_s": _engine_imports(r),
                  "daemon_gentle_s": disk.get("gentle_seconds"),
                  **{k: disk.get(k) for k in ("hold", "hold_max", "longest_hold", "reads_seen",
                                              "read_events")},
                  "weights_from": r.get("weights_from")}
    out["summary"] = s
    return out


def fresh_node(model: Path, device: str, *, smoke: bool) -> dict[str, Any]:
    """Time to first logits on a node new to the model: cache path against disk path. The
    daemon starts as on such a node: every cache dropped, no import set of its own, the agent
    image's seed (`_first_start_env`)."""
    from weightcache.bench.load import Launcher, drop

    files = sorted(model.glob("*.safetensors"))
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="wc-fresh-node-"))
    env, out["seed"] = _first_start_env(work)
    out["cache_overlapped"] = overlapped(model, device, env)
    log(f"  fresh-node cache_overlapped {json.dumps(out['cache_overlapped'])[:600]}")
    # Today's order: READY first, then the engine starts.
    if not smoke:
        sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
        os.chmod(sockdir, 0o700)
        Path(env["WEIGHTCACHE_IMPORT_SET"]).unlink(missing_ok=True)  # a first start again
        drop(files)
        t0 = time.time()
        launcher = Launcher(model, sockdir, env, device=device)
        try:
            r = spawn("cache", model, launcher.socket, device=device)
            r["daemon_ready_s"] = round(launcher.wall, 3)
            r["first_logits_from_node_start_s"] = round(
                launcher.wall + (r.get("first_logits_seconds") or 0), 3)
            out["cache_after_ready"] = r
        finally:
            launcher.stop()
            shutil.rmtree(sockdir, ignore_errors=True)
        del t0
        log(f"  fresh-node cache_after_ready {json.dumps(out['cache_after_ready'])[:600]}")
    shutil.rmtree(work, ignore_errors=True)
    for source in ("disk",) if smoke else ("disk", "from_pretrained"):
        drop(files)
        out[source] = spawn(source, model, None, device=device)
        log(f"  fresh-node {source} {json.dumps(out[source])[:600]}")
    s: dict[str, Any] = {}
    cache = out["cache_overlapped"].get("first_logits_seconds")
    s["cache_overlapped_first_logits_s"] = cache
    s["cache_overlapped_weights_from"] = out["cache_overlapped"].get("weights_from")
    s["cache_overlapped_seeded"] = (out["cache_overlapped"].get("daemon_import_prefetch")
                                    or {}).get("seeded")
    after = (out.get("cache_after_ready") or {}).get("first_logits_from_node_start_s")
    if after:
        s["cache_after_ready_first_logits_s"] = after
    for source in ("disk", "from_pretrained"):
        v = (out.get(source) or {}).get("first_logits_seconds")
        if v:
            s[f"{source}_first_logits_s"] = v
            if cache:
                s[f"cache_overlapped_vs_{source}"] = round(v / cache, 3)
    s.update(_where_the_overlap_went(out))
    out["summary"] = s
    return out


def _engine_imports(run: dict[str, Any] | None) -> float | None:
    """`import torch` and `import transformers` of one engine start, in seconds; None when
    either is missing."""
    phases = (run or {}).get("phases") or {}
    parts = [phases.get(k) for k in IMPORT_PHASES]
    return round(sum(parts), 3) if all(isinstance(p, (int, float)) for p in parts) else None


def _imports_use(run: dict[str, Any] | None) -> dict[str, Any] | None:
    """The imports' use (`phase_use` of `import torch` and `import transformers` summed):
    seconds on a CPU, waiting for one (null where not counted), off a CPU, and disk reads."""
    use = (run or {}).get("phase_use") or {}
    parts = [use.get(k) for k in IMPORT_PHASES]
    if not all(parts):
        return None
    out: dict[str, Any] = {}
    for key in ("cpu_s", "runqueue_s", "off_cpu_s", "read_mb"):
        values = [p.get(key) for p in parts]
        out[key] = None if None in values else round(sum(values), 3)
    return out


def _where_the_overlap_went(out: dict[str, Any]) -> dict[str, Any]:
    """Which of the two starts bounded the cache path: the daemon's READY, or the engine's
    imports, which read the disk beside the daemon's load (on an H100 VM, run60: transformers
    imported in 15.1 s there against 10.6 s from disk alone, while the daemon was READY at
    12.3 s). `engine_imports_s`: `import torch` and `import transformers` of one start."""
    s: dict[str, Any] = {}
    overlapped = out.get("cache_overlapped") or {}
    if isinstance(overlapped.get("daemon_ready_s"), (int, float)):
        s["cache_overlapped_daemon_ready_s"] = overlapped["daemon_ready_s"]
    beside, alone = _engine_imports(overlapped), _engine_imports(out.get("disk"))
    if beside is not None:
        s["cache_overlapped_engine_imports_s"] = beside
    if alone is not None:
        s["disk_engine_imports_s"] = alone
        if beside:
            s["engine_imports_beside_load_vs_alone"] = round(beside / alone, 3)
    for key, run in (("cache_overlapped", overlapped), ("disk", out.get("disk"))):
        used = _imports_use(run)
        if used is not None:
            s[f"{key}_engine_imports_use"] = used
    return s


def _print(report: dict[str, Any]) -> None:
    from weightcache.bench.report import print_ratios

    rc = report.get("restart_compile") or {}
    rows = [(k, (rc.get(k) or {}).get("phases", {}).get("compile") or 0.0)
            for k in ("dirs_second", "aot_first", "aot_second")]
    first = (rc.get("dirs_first") or {}).get("phases", {}).get("compile")
    if first:
        print_ratios("compile step (compile + first forward), fresh processes, weights from the"
                     " cache", ("dirs_first (empty dir)", first), [r for r in rows if r[1]])
    for label in ("none", "dirs_first", "dirs_second", "aot_first", "aot_second"):
        r = rc.get(label) or {}
        print(f"    {label:<12} {json.dumps(r.get('phases') or r.get('error'))}"
              f" {json.dumps((r.get('compiled') or {}).get('counters', {}))}")
    fn = report.get("fresh_node") or {}
    base = (fn.get("disk") or {}).get("first_logits_seconds")
    if base:
        rows = [("cache, daemon + engine started together",
                 (fn.get("cache_overlapped") or {}).get("first_logits_seconds") or 0.0)]
        if (fn.get("cache_after_ready") or {}).get("first_logits_from_node_start_s"):
            rows.append(("cache, engine after READY",
                         fn["cache_after_ready"]["first_logits_from_node_start_s"]))
        if (fn.get("from_pretrained") or {}).get("first_logits_seconds"):
            rows.append(("from_pretrained", fn["from_pretrained"]["first_logits_seconds"]))
        print_ratios("fresh node: time to first logits (page cache dropped)",
                     ("disk (load_file), engine alone", base), rows)
        s = fn.get("summary") or {}
        if "cache_overlapped_engine_imports_s" in s:
            print(f"    cache path: daemon READY {s.get('cache_overlapped_daemon_ready_s')} s;"
                  f" the engine's imports {s['cache_overlapped_engine_imports_s']} s beside the"
                  f" load, {s.get('disk_engine_imports_s')} s alone")
            print("    the imports' use beside the load"
                  f" {s.get('cache_overlapped_engine_imports_use')},"
                  f" alone {s.get('disk_engine_imports_use')}")
    ab = (report.get("hold_ab") or {}).get("summary") or {}
    if ab:
        before = report["hold_ab"].get("before_env")
        named = f" (before: {' '.join(f'{k}={v}' for k, v in before.items())})" if before else ""
        print("  fresh node, cache path: the disk share as it is (default) and as before, in turn"
              + named)
        for key, row in ab.items():
            print(f"    {key:<10} first logits {row.get('first_logits_s')} s, daemon READY"
                  f" {row.get('daemon_ready_s')} s, engine imports {row.get('engine_imports_s')}"
                  f" s, daemon gentle {row.get('daemon_gentle_s')} s, read events"
                  f" {row.get('read_events')}")
    sys.stdout.flush()


def run_section(device: str, smoke: bool, shape: str, workdir: Path,
                parts: set[str]) -> dict[str, Any]:
    report: dict[str, Any] = {"section": "restart", "device": device, "shape": shape,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    model = workdir / f"llama-{shape}"
    log(f"writing the {shape} checkpoint")
    report["checkpoint"] = write_checkpoint(model, device, shape)
    log(f"  {report['checkpoint']}")
    out_path = os.environ.get("WEIGHTCACHE_BENCH_RESTART_OUT")

    def save() -> None:
        if out_path:
            Path(out_path).write_text(json.dumps(report, indent=2))

    if "compile" in parts:
        report["restart_compile"] = restart_compile(model, device, workdir, smoke=smoke)
        log(f"restart-compile summary {json.dumps(report['restart_compile']['summary'])}")
        save()
    if "fresh" in parts:
        report["fresh_node"] = fresh_node(model, device, smoke=smoke)
        log(f"fresh-node summary {json.dumps(report['fresh_node']['summary'])}")
        save()
    if "holdab" in parts:
        report["hold_ab"] = hold_ab(model, device, rounds=1 if smoke else 2)
        log(f"hold-ab summary {json.dumps(report['hold_ab']['summary'])}")
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    return report


def main(argv: list[str]) -> int:
    if argv and argv[0] in SOURCES:
        source, model_dir, sock, spawned = argv[:4]
        result = child(source, model_dir, None if sock == "-" else sock, float(spawned))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import argparse

    from weightcache.bench.report import add_smoke_flag

    p = argparse.ArgumentParser(prog="weightcache bench restart")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_smoke_flag(p)
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("  skipped: no CUDA device", flush=True)
            return 0
    shape = os.environ.get("WEIGHTCACHE_BENCH_RESTART_MODEL") or (
        "8b" if args.device == "cuda" else "tiny" if args.smoke else "small")
    parts = set(os.environ.get("WEIGHTCACHE_BENCH_RESTART_PARTS", "compile,fresh").split(","))
    if "holdab" in parts:
        from weightcache.bench.load import share_before

        share_before()  # a bad comparison is told before the checkpoint is written
    workdir = Path(os.environ.get("WEIGHTCACHE_BENCH_RESTART_WORKDIR") or
                   tempfile.mkdtemp(prefix="wc-restart-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = run_section(args.device, args.smoke, shape, workdir, parts)
    finally:
        if not os.environ.get("WEIGHTCACHE_BENCH_RESTART_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
    _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
