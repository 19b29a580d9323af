"""Bench section `attach`: what an attach costs per tensor, for one shard, in copy mode and
under a burst, against `load_file` of the same files in the same run.

Parts (WEIGHTCACHE_BENCH_ATTACH_PARTS, default all):
- `shard`: the 291-tensor Llama-3.1-8B-shaped shard (16.06 GB with `--device cuda`; the
  same 291 names at small dimensions on CPU). Attach through the public client
  (`weightcache.client.attach`, zero copy, fallback off): the first attach in this process
  (torch imported, plan not yet made), the median of repeats, the plan alone (kept and
  made anew) and, on CUDA, copy mode end to end (one copy of the arena, then views) in TB/s.
- `fresh`: the same shard's first load in new processes, as an engine's restart has it
  (torch imported and, on CUDA, the context made off the clock): copy mode, zero copy, a
  bare allocation of the shard's size and `load_file` of its files, and both modes with the
  ctypes driver binding (`WEIGHTCACHE_CUDA_DRIVER=ctypes`), in turn over 4 rounds,
  each process's exit freeing its memory before the next starts; copy mode's and zero copy's
  second attach in the same process beside them.
- `scaling`: one file of N 1 KiB tensors named like MoE experts, N = 300 / 3,000 / 30,000 /
  100,000 (smoke: 30 / 300): the median attach, the first attach of each count with no
  kept plan, and the marginal cost per tensor (least squares over the counts), with
  `load_file` of the same file as the baseline.
- `burst` (CPU; not run by default with `--device cuda`): 200 attaches at once (8 processes
  x 25 threads, each process new to the checkpoint, as engines starting together) of the
  demo checkpoint: p50 / p99 / max, one idle attach and its plan, against one `load_file`
  of the same files.

Checkpoints are sparse files (the header is real, the data a hole that reads as zeros):
attach time depends on the table and the mapping, not on the values, and a 16 GB shard then
takes no time to write. Every figure is printed; `WEIGHTCACHE_BENCH_ATTACH_OUT` also writes
them as JSON. Targets are shown, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightcache.bench.report import add_smoke_flag, print_ratios

TARGETS = {"attach_ms_median_291": 10.0, "first_attach_ms_291": 50.0,
           "marginal_us_per_tensor": 5.0, "copy_tb_per_s": 1.5}
LLAMA_8B = dict(hidden=4096, intermediate=14336, layers=32, kv=1024, vocab=128256)
SMALL_8B = dict(hidden=256, intermediate=512, layers=32, kv=64, vocab=1024)  # 291 names, CPU


def llama_specs(hidden: int, intermediate: int, layers: int, kv: int, vocab: int
                ) -> list[tuple[str, list[int]]]:
    """The 291 bf16 tensors of a Llama-3.1-8B `save_pretrained` (untied head)."""
    out = [("model.embed_tokens.weight", [vocab, hidden]), ("model.norm.weight", [hidden]),
           ("lm_head.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [hidden]),
                (p + "post_attention_layernorm.weight", [hidden]),
                (p + "self_attn.q_proj.weight", [hidden, hidden]),
                (p + "self_attn.k_proj.weight", [kv, hidden]),
                (p + "self_attn.v_proj.weight", [kv, hidden]),
                (p + "self_attn.o_proj.weight", [hidden, hidden]),
                (p + "mlp.gate_proj.weight", [intermediate, hidden]),
                (p + "mlp.up_proj.weight", [intermediate, hidden]),
                (p + "mlp.down_proj.weight", [hidden, intermediate])]
    return out


def expert_specs(n: int) -> list[tuple[str, list[int]]]:
    """n 1 KiB bf16 tensors named like an MoE checkpoint's experts."""
    per_layer = 3 * 256
    return [(f"model.layers.{i // per_layer}.mlp.experts.{i % per_layer // 3}."
             f"{('gate_proj', 'up_proj', 'down_proj')[i % 3]}.weight", [512]) for i in range(n)]


def write_sparse(path: Path, specs: list[tuple[str, list[int]]], files: int = 1) -> Path:
    """A bf16 safetensors checkpoint of `specs` in `files` files (+ index when > 1); the data
    sections are holes."""
    from weightcache.testing.checkpoints import split_specs, write_bf16_files

    write_bf16_files(path, split_specs(specs, files), config={"tie_word_embeddings": False})
    return path


def _forget_plans() -> None:
    """Empty this process' kept plans (a client without them has none to empty: the same
    bench then measures an older tree for comparison)."""
    try:
        from weightcache.native.engine.attach import PLANS
    except ImportError:
        return
    PLANS.clear()


def _aged(path: Path) -> None:
    """Wait until what was just written is older than the plan cache's racy window, as a
    checkpoint an engine attaches is (a plan of files written within it is not kept)."""
    try:
        from weightcache.native.engine.plancache import RACY_S
    except ImportError:
        RACY_S = 0.0
    newest = max(max(p.stat().st_mtime, p.stat().st_ctime) for p in [path, *path.iterdir()])
    time.sleep(max(0.0, newest + RACY_S + 0.1 - time.time()))


class Daemon:
    """The real `weightcache preload` for one checkpoint, on `device`."""

    def __init__(self, model: Path, device: str) -> None:
        from weightcache.testing.processes import Preload

        self.sockets = Path(tempfile.mkdtemp(prefix="wc-attach-sock-"))
        os.chmod(self.sockets, 0o700)
        self.proc = Preload(["--model", str(model), "--device", device.split(":")[0],
                             "--weight-cache-socket-dir", str(self.sockets)])
        self.ready = self.proc.wait_ready(600)
        self.socket = self.ready["sockets"][0]

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timed(fn: Any) -> float:
    """Seconds `fn` takes; what it returns (an attach's tensors) is freed after the clock
    stops, as an engine keeps its weights."""
    t0 = time.perf_counter()
    kept = fn()  # noqa: F841  (freed on return, after the clock)
    return time.perf_counter() - t0


def _attach(model: Path, device: str, sock: str, mode: str = "zero_copy", **kw: Any) -> Any:
    from weightcache.client import attach

    res = attach(model, device=device, socket_path=sock, fallback=False, mode=mode, **kw)
    _sync(device)
    if res.source != "cache":
        raise RuntimeError(f"attach fell back to disk: {res.reason}")
    return res


def _phases(results: list[Any]) -> dict[str, float]:
    """Median ms per attach phase (AttachResult.phases) over `results`."""
    names = list(dict.fromkeys(k for r in results for k in r.phases))  # in attach order
    return {k: _ms(statistics.median(r.phases.get(k, 0.0) for r in results)) for k in names}


def _timed_attaches(n: int, fn: Any, before: Any = None) -> tuple[list[float], list[Any]]:
    """`n` timed calls of `fn`, and their results' phases (the tensors are dropped);
    `before()` runs ahead of each, off the clock."""
    times, results = [], []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
        results.append(argparse.Namespace(phases=dict(getattr(res, "phases", {}))))
        del res
    return times, results


def _load_file(model: Path, device: str) -> None:
    from safetensors.torch import load_file

    for f in sorted(model.glob("*.safetensors")):
        load_file(str(f), device=device)
    _sync(device)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _first_and_median(model: Path, device: str, sock: str, repeat: int) -> dict[str, Any]:
    """First attach with no kept plan (the plan cache emptied), then `repeat` attaches."""
    _forget_plans()
    first, first_res = _timed_attaches(1, lambda: _attach(model, device, sock))
    times, kept = _timed_attaches(repeat, lambda: _attach(model, device, sock))
    unkept, unkept_res = [], []
    for _ in range(max(1, repeat // 4)):
        _forget_plans()
        t, r = _timed_attaches(1, lambda: _attach(model, device, sock))
        unkept += t
        unkept_res += r
    return {"first_ms": _ms(first[0]), "median_ms": _ms(statistics.median(times)),
            "min_ms": _ms(min(times)), "max_ms": _ms(max(times)),
            "no_kept_plan_median_ms": _ms(statistics.median(unkept)), "repeat": repeat,
            "first_phases_ms": _phases(first_res), "phases_ms": _phases(kept),
            "no_kept_plan_phases_ms": _phases(unkept_res)}


def _plan_ms(model: Path, device: str, cache: bool, repeat: int) -> float:
    import torch

    from weightcache.native.engine.attach import plan_rank

    dev = torch.device(device)
    index = dev.index or 0

    kw = {"cache": cache} if "cache" in inspect.signature(plan_rank).parameters else {}

    def once() -> None:
        plan_rank(model, device=dev, device_index=index, tp_size=1, tp_rank=0,
                  shard_rules=None, dtype="auto", **kw)

    once()
    return _ms(statistics.median(_timed(once) for _ in range(repeat)))


def _copy_figures(model: Path, device: str, sock: str, nbytes: int, smoke: bool
                  ) -> dict[str, Any]:
    """Copy mode end to end: into fresh memory (the allocator emptied before each, as an
    engine's first load), into a kept allocator block, and into the caller's block (`out=`),
    each with its phases (attach, alloc, copy, views, release, check). On CUDA each also
    `_settled`: with the copy-mode thread's work left by the attach before (the unmap of its
    mapping) done and the device idle first; the ways run in turn. (An engine's first load
    in a new process is the `fresh` part's.)"""
    import torch

    from weightcache.native.engine.attach import _Allocator

    n = 2 if smoke else 5
    cuda = device.startswith("cuda")
    block = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else None

    def empty() -> None:
        # Each copy allocates its 16 GB anew, as an engine's first load does; giving the last
        # one back to the driver is off the clock (an engine has no earlier copy to free).
        if cuda:
            torch.cuda.empty_cache()

    def settled(before: Any) -> Any:
        def run() -> None:
            _Allocator.settle(30)
            if before is not None:
                before()
            torch.cuda.synchronize()
        return run

    ways: list[tuple[str, Any, dict[str, Any]]] = [
        ("copy", empty, {}), ("copy_reused_block", None, {}), ("copy_into_out", None, {})]
    if cuda:
        ways = [ways[0], ("copy_settled", settled(empty), {}),
                ways[1], ("copy_reused_block_settled", settled(None), {}),
                ("copy_into_out", None, {"out": block}),
                ("copy_into_out_settled", settled(None), {"out": block})]
    else:
        ways[2] = ("copy_into_out", None,
                   {"out": torch.empty(nbytes, dtype=torch.uint8, device=device)})
    got: dict[str, tuple[list[float], list[Any]]] = {name: ([], []) for name, _, _ in ways}
    for _ in range(n):
        for name, before, kw in ways:
            t, r = _timed_attaches(1, functools.partial(_attach, model, device, sock, "copy",
                                                        **kw), before=before)
            got[name][0].extend(t)
            got[name][1].extend(r)
    out: dict[str, Any] = {}
    for name, (times, res) in got.items():
        med = statistics.median(times)
        out[f"{name}_median_s"] = round(med, 5)
        out[f"{name}_tb_per_s"] = round(nbytes / med / 1e12, 3)
        out[f"{name}_phases_ms"] = _phases(res)
    copies = got["copy"][0]
    out["copy_first_s"] = round(copies[0], 5)
    out["copy_tb_per_s_first"] = round(nbytes / copies[0] / 1e12, 3)
    out["copy_tb_per_s_median"] = out["copy_tb_per_s"]
    return out


# An engine's first load: a new process (torch imported and the CUDA context made off the clock),
# its first attach and a second one; or (`alloc`) only a fresh block of the shard's size; or
# (`load_file`) the files loaded as an engine without the cache does.
_FRESH_CHILD = r"""
import json, sys, time
import torch
model, sock, mode, nbytes, device = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                     sys.argv[5])
cuda = device.startswith("cuda")
sync = torch.cuda.synchronize if cuda else (lambda: None)
torch.empty(1, device=device)
sync()
from weightcache.client import attach
out = {}
if mode == "alloc":
    t = time.perf_counter()
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync()
    out["first_ms"] = (time.perf_counter() - t) * 1e3
elif mode == "load_file":
    from pathlib import Path
    from weightcache.bench.attach import _load_file
    t = time.perf_counter()
    _load_file(Path(model), device)
    out["first_ms"] = (time.perf_counter() - t) * 1e3
else:
    for key in ("first", "second"):
        t = time.perf_counter()
        res = attach(model, device=device, socket_path=sock, mode=mode, fallback=False)
        sync()
        out[key + "_ms"] = (time.perf_counter() - t) * 1e3
        out[key + "_phases_ms"] = {k: round(v * 1e3, 3) for k, v in res.phases.items()}
        out["source"] = res.source
        del res
print("RESULT " + json.dumps(out))
"""


def child_result(code: str, args: list[str], env: dict[str, str] | None = None,
                 what: str = "child") -> dict[str, Any]:
    """`code` run in a new interpreter with `args`: the JSON its last `RESULT ` line carries
    (RuntimeError with its stderr where it failed or printed none)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{what} process failed: {proc.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT "):])


def _fresh_processes(model: Path, sock: str, nbytes: int, rounds: int, device: str
                     ) -> dict[str, Any]:
    """Copy mode, zero copy, a bare allocation of the shard's size and `load_file` of its
    files (the page cache holds them: sparse), each as the first load of a new process, in
    turn for `rounds` rounds (each process's exit frees its memory before the next starts,
    as an engine's restart does); and both modes with the ctypes driver binding chosen
    (`copy_ctypes`, `zero_copy_ctypes`: WEIGHTCACHE_CUDA_DRIVER=ctypes, cudadriver.py). On
    CPU no driver binding is called: there those two only run the bench's own code."""
    from weightcache.native.shared import cudadriver

    ways = ("copy", "zero_copy", "alloc", "load_file", "copy_ctypes", "zero_copy_ctypes")
    got: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for r in range(rounds):
        for w in ways[r % len(ways):] + ways[:r % len(ways)]:
            env = {**os.environ, cudadriver.DRIVER_ENV: cudadriver.CTYPES
                   if w.endswith("_ctypes") else cudadriver.BINDINGS}
            got[w].append(child_result(
                _FRESH_CHILD, [str(model), sock, w.removesuffix("_ctypes"), str(nbytes), device],
                env, f"fresh {w}"))
    out: dict[str, Any] = {"rounds": rounds}
    for w, runs in got.items():
        firsts = [x["first_ms"] for x in runs]
        out[w] = {"first_ms": [round(v, 3) for v in firsts],
                  "first_median_ms": round(statistics.median(firsts), 3)}
        if w.removesuffix("_ctypes") in ("copy", "zero_copy"):
            seconds = [x["second_ms"] for x in runs]
            out[w]["second_median_ms"] = round(statistics.median(seconds), 3)
            out[w]["first_phases_ms"] = runs[firsts.index(sorted(firsts)[len(firsts) // 2])][
                "first_phases_ms"]
            out[w]["source"] = sorted({x["source"] for x in runs})
        if w.startswith("copy"):
            out[w]["first_tb_per_s"] = round(nbytes / (out[w]["first_median_ms"] / 1e3)
                                             / 1e12, 3)
            out[w]["second_tb_per_s"] = round(nbytes / (out[w]["second_median_ms"] / 1e3)
                                              / 1e12, 3)
    return out


def _phase_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" for k, v in phases.items())


# -- parts --------------------------------------------------------------------------------
@contextlib.contextmanager
def _served_shard(work: Path, name: str, device: str, smoke: bool) -> Any:
    """The 291-tensor shard (Llama-3.1-8B's shapes on CUDA, small ones on CPU or in a smoke
    run) written sparse and served by a daemon: (its directory, the daemon)."""
    dims = LLAMA_8B if device.startswith("cuda") and not smoke else SMALL_8B
    model = write_sparse(work / name, llama_specs(**dims), files=4)
    _aged(model)
    daemon = Daemon(model, device)
    try:
        yield model, daemon
    finally:
        daemon.stop()
        shutil.rmtree(model, ignore_errors=True)


def part_shard(work: Path, device: str, smoke: bool) -> dict[str, Any]:
    with _served_shard(work, "shard", device, smoke) as (model, daemon):
        out: dict[str, Any] = {"tensors": 291, "bytes": daemon.ready["bytes"]}
        # An engine imports the client when it starts, before its first attach: timed on
        # its own (0 when an earlier part imported it).
        t0 = time.perf_counter()
        import weightcache.client  # noqa: F401

        out["import_client_ms"] = _ms(time.perf_counter() - t0)
        out["load_file_s"] = round(statistics.median(
            _timed(lambda: _load_file(model, device))
            for _ in range(1 if smoke or device.startswith("cuda") else 3)), 4)
        out.update(_first_and_median(model, device, daemon.socket, 3 if smoke else 20))
        out["plan_kept_ms"] = _plan_ms(model, device, True, 3 if smoke else 20)
        out["plan_made_ms"] = _plan_ms(model, device, False, 3 if smoke else 10)
        if device.startswith("cuda") or smoke:
            out.update(_copy_figures(model, device, daemon.socket, out["bytes"], smoke))
        return out


def part_fresh(work: Path, device: str, smoke: bool) -> dict[str, Any]:
    """The 291-tensor shard's first load in new processes: `_fresh_processes`."""
    with _served_shard(work, "fresh", device, smoke) as (model, daemon):
        nbytes = daemon.ready["bytes"]
        return {"tensors": 291, "bytes": nbytes,
                **_fresh_processes(model, daemon.socket, nbytes, 2 if smoke else 4, device)}


def part_scaling(work: Path, device: str, smoke: bool) -> list[dict[str, Any]]:
    counts = [30, 300] if smoke else [300, 3_000, 30_000, 100_000]
    rows = []
    for n in counts:
        model = write_sparse(work / f"experts-{n}", expert_specs(n))
        _aged(model)
        daemon = Daemon(model, device)
        try:
            repeat = 3 if smoke else (20 if n <= 3_000 else 5)
            row: dict[str, Any] = {"tensors": n}
            row.update(_first_and_median(model, device, daemon.socket, repeat))
            row["load_file_ms"] = _ms(statistics.median(
                _timed(functools.partial(_load_file, model, device))
                for _ in range(max(2, repeat // 2))))
            row["us_per_tensor"] = round(row["median_ms"] * 1e3 / n, 3)
            rows.append(row)
        finally:
            daemon.stop()
            shutil.rmtree(model, ignore_errors=True)
    return rows


def _slope_us(rows: list[dict[str, Any]], key: str) -> float:
    xs, ys = [r["tensors"] for r in rows], [r[key] * 1e3 for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den, 3)


def _burst_child(args: tuple[str, str, int, float]) -> list[float]:
    model, sock, threads, start_at = args
    _forget_plans()  # each process is an engine new to the checkpoint

    def one(_: int) -> float:
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        res = _attach(Path(model), "cpu", sock)
        assert res.source == "cache", res.reason
        return time.perf_counter() - t0

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(threads)))


def part_burst(work: Path, smoke: bool) -> dict[str, Any]:
    from weightcache.testing.checkpoints import DEMO, TINY, write_llama_checkpoint

    model = write_llama_checkpoint(work / "demo", TINY if smoke else DEMO, files=2)
    _aged(model)
    daemon = Daemon(model, "cpu")
    procs, threads = (2, 5) if smoke else (8, 25)
    try:
        out: dict[str, Any] = {"attaches": procs * threads, "processes": procs}
        out["load_file_ms"] = _ms(statistics.median(
            _timed(lambda: _load_file(model, "cpu")) for _ in range(3)))
        idle = _first_and_median(model, "cpu", daemon.socket, 3 if smoke else 20)
        out["idle_attach_ms"] = idle["median_ms"]
        out["idle_attach_no_kept_plan_ms"] = idle["no_kept_plan_median_ms"]
        out["idle_plan_kept_ms"] = _plan_ms(model, "cpu", True, 10)
        out["idle_plan_made_ms"] = _plan_ms(model, "cpu", False, 10)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(procs) as pool:
            start_at = time.time() + 1.0  # every thread starts together, once forked
            per = pool.map(_burst_child, [(str(model), daemon.socket, threads, start_at)] * procs)
        lat = sorted(x for chunk in per for x in chunk)
        q = statistics.quantiles(lat, n=100, method="inclusive")
        out.update(p50_ms=_ms(statistics.median(lat)), p99_ms=_ms(q[98]), max_ms=_ms(lat[-1]))
        return out
    finally:
        daemon.stop()
        shutil.rmtree(model, ignore_errors=True)


# -- report -------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache bench attach")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_smoke_flag(p)
    args = p.parse_args(argv)
    device = args.device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("  skipped: --device cuda but no CUDA device is visible")
            return 0
        device = "cuda:0" if device == "cuda" else device
        torch.cuda.set_device(torch.device(device))
        torch.empty(0, device=device)  # the CUDA context exists before the first attach
    import logging

    logging.getLogger("weightcache.client").setLevel(logging.ERROR)
    default = "shard,fresh,scaling" if device.startswith("cuda") else "shard,fresh,scaling,burst"
    parts = set((os.environ.get("WEIGHTCACHE_BENCH_ATTACH_PARTS") or default).split(","))
    work = Path(os.environ.get("WEIGHTCACHE_BENCH_ATTACH_WORKDIR") or
                tempfile.mkdtemp(prefix="wc-attach-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"section": "attach", "device": device, "targets": TARGETS,
                              "smoke": args.smoke}
    lock = threading.Lock()

    def save() -> None:
        if out := os.environ.get("WEIGHTCACHE_BENCH_ATTACH_OUT"):
            with lock:
                Path(out).write_text(json.dumps(report, indent=2))

    try:
        if "shard" in parts:
            s = report["shard"] = part_shard(work, device, args.smoke)
            save()
            rows = [("attach, first in process (no plan yet)", s["first_ms"] / 1e3),
                    ("attach, median", s["median_ms"] / 1e3),
                    ("attach, median with no kept plan", s["no_kept_plan_median_ms"] / 1e3)]
            notes = [f"plan kept {s['plan_kept_ms']} ms, made anew {s['plan_made_ms']} ms;"
                     f" targets: median <= {TARGETS['attach_ms_median_291']} ms, first <="
                     f" {TARGETS['first_attach_ms_291']} ms; importing weightcache.client"
                     f" before it took {s['import_client_ms']} ms",
                     f"phases of the first attach, ms: {_phase_line(s['first_phases_ms'])}",
                     f"phases, median: {_phase_line(s['phases_ms'])}",
                     f"phases with no kept plan: {_phase_line(s['no_kept_plan_phases_ms'])}"]
            if "copy_median_s" in s:
                rows += [("copy mode end to end, median", s["copy_median_s"]),
                         ("copy mode into a kept allocator block", s["copy_reused_block_median_s"]),
                         ("copy mode into the caller's block (out=)",
                          s["copy_into_out_median_s"])]
                notes.append(f"copy mode {s['copy_tb_per_s_median']} TB/s median,"
                             f" {s['copy_tb_per_s_first']} TB/s first,"
                             f" {s['copy_reused_block_tb_per_s']} TB/s into a kept allocator"
                             f" block, {s['copy_into_out_tb_per_s']} TB/s into out="
                             f" (target >= {TARGETS['copy_tb_per_s']})")
                settled = {k.removesuffix("_settled_tb_per_s"): v for k, v in s.items()
                           if k.endswith("_settled_tb_per_s")}
                if settled:
                    notes.append("settled first (TB/s): " + ", ".join(
                        f"{k} {v}" for k, v in settled.items()))
                for name in [k[:-len("_phases_ms")] for k in s if k.startswith("copy")
                             and k.endswith("_phases_ms")]:
                    notes.append(f"{name} phases, ms: {_phase_line(s[name + '_phases_ms'])}")
            print_ratios(f"attach ({device}): 291 tensors, {s['bytes'] / 1e9:.2f} GB",
                         ("load_file of the same files", s["load_file_s"]), rows, notes=notes)
        if "fresh" in parts:
            f = report["fresh"] = part_fresh(work, device, args.smoke)
            save()
            print_ratios(
                f"attach ({device}): a new process's first load, {f['bytes'] / 1e9:.2f} GB",
                ("load_file of the same files (page cache)",
                 f["load_file"]["first_median_ms"] / 1e3),
                [("copy mode, first attach", f["copy"]["first_median_ms"] / 1e3),
                 ("copy mode, second attach", f["copy"]["second_median_ms"] / 1e3),
                 ("zero copy, first attach", f["zero_copy"]["first_median_ms"] / 1e3),
                 ("a fresh block of the shard's size", f["alloc"]["first_median_ms"] / 1e3)]
                + [(f"{label}, first attach, ctypes driver binding",
                    f[f"{mode}_ctypes"]["first_median_ms"] / 1e3)
                   for mode, label in (("copy", "copy mode"), ("zero_copy", "zero copy"))],
                notes=[f"copy mode {f['copy']['first_tb_per_s']} TB/s first,"
                       f" {f['copy']['second_tb_per_s']} TB/s second"
                       f" (target >= {TARGETS['copy_tb_per_s']})",
                       f"copy's first phases, ms: {_phase_line(f['copy']['first_phases_ms'])}",
                       f"firsts, ms: copy {f['copy']['first_ms']}, zero copy"
                       f" {f['zero_copy']['first_ms']}, allocation {f['alloc']['first_ms']},"
                       f" load_file {f['load_file']['first_ms']}"])
        if "scaling" in parts:
            rows = report["scaling"] = part_scaling(work, device, args.smoke)
            report["marginal_us_per_tensor"] = _slope_us(rows, "median_ms")
            report["marginal_us_per_tensor_no_kept_plan"] = _slope_us(
                rows, "no_kept_plan_median_ms")
            report["marginal_us_per_tensor_load_file"] = _slope_us(rows, "load_file_ms")
            save()
            print(f"  attach scaling ({device}), 1 KiB tensors, ms (x = load_file / attach)")
            print(f"    {'tensors':>8} {'attach':>9} {'no plan':>9} {'first':>9} {'load_file':>10}"
                  f" {'us/tensor':>10} {'x':>7}")
            for r in rows:
                print(f"    {r['tensors']:>8} {r['median_ms']:>9.2f} "
                      f"{r['no_kept_plan_median_ms']:>9.2f} {r['first_ms']:>9.2f} "
                      f"{r['load_file_ms']:>10.2f} {r['us_per_tensor']:>10.2f} "
                      f"{r['load_file_ms'] / r['median_ms']:>7.1f}")
            print(f"    marginal per tensor: attach {report['marginal_us_per_tensor']} us,"
                  f" with no kept plan {report['marginal_us_per_tensor_no_kept_plan']} us,"
                  f" load_file {report['marginal_us_per_tensor_load_file']} us"
                  f" (target <= {TARGETS['marginal_us_per_tensor']} us)")
        if "burst" in parts:
            b = report["burst"] = part_burst(work, args.smoke)
            save()
            print_ratios(
                f"attach burst (cpu): {b['attaches']} attaches at once from {b['processes']}"
                " processes, demo checkpoint",
                ("load_file of the same files, idle", b["load_file_ms"] / 1e3),
                [("attach, idle, median", b["idle_attach_ms"] / 1e3),
                 ("attach under the burst, p50", b["p50_ms"] / 1e3),
                 ("attach under the burst, p99", b["p99_ms"] / 1e3)],
                notes=[f"idle plan kept {b['idle_plan_kept_ms']} ms, made anew"
                       f" {b['idle_plan_made_ms']} ms; idle attach with no kept plan"
                       f" {b['idle_attach_no_kept_plan_ms']} ms; burst max {b['max_ms']} ms"])
        save()
        return 0
    finally:
        if not os.environ.get("WEIGHTCACHE_BENCH_ATTACH_WORKDIR"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
