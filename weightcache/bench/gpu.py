"""GPU benchmark (`weightcache bench --device cuda`): the "gpu" section.

For each model shape (Llama-3.2-1B, Llama-3.1-8B, optionally a ~32 GB Llama-70B-shaped
slice), on a generated bf16 safetensors checkpoint with random (never zero) data:
- the baseline a restarting engine pays today: `safetensors.torch.load_file(device="cuda")`
  with the page cache warm and dropped;
- the cold loader filling a VMM arena (several thread/chunk settings, buffered and O_DIRECT),
  plus the two bounds it cannot beat: raw disk read rate and pinned host-to-device rate;
- the real daemon's load (its own `load_seconds` and the wall time until it serves);
- attach through the real client library: zero_copy on the VMM and legacy IPC paths (median
  of repeated attaches), copy mode end to end and the device clone rate;
- GPU memory held by the daemon and added by an attached client (cudaMemGetInfo, NVML).
Targets are reported next to the figures, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightcache.bench.report import add_smoke_flag

GB = 1e9
MiB = 1 << 20
SHARD_BYTES = 5 * 10**9

TARGETS = {
    "attach_zero_copy_ms_max": 15.0,
    "copy_tb_per_s_min": 1.5,
    "cold_load_vs_load_file_dropped_min": 3.0,
    "warm_load_gb_per_s_min": 15.0,
}


# -- shapes -------------------------------------------------------------------------------
def llama_shapes(
    *, layers: int, hidden: int, inter: int, kv: int, vocab: int, tied: bool
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face Llama checkpoint (unfused projections)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(layers=16, hidden=2048, inter=8192, kv=512, vocab=128256, tied=True),
    "llama-3.1-8b": dict(layers=32, hidden=4096, inter=14336, kv=1024, vocab=128256, tied=False),
    # The first 16 layers of Llama-3.1-70B: ~32 GB, the size class of 30-70 GB checkpoints.
    "llama-70b-16l": dict(layers=16, hidden=8192, inter=28672, kv=1024, vocab=128256, tied=False),
}
ALIASES = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b", "32g": "llama-70b-16l"}


def write_checkpoint(path: Path, spec: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Stream a sharded bf16 safetensors checkpoint to disk (no full copy in memory).

    Another `seed` gives the same headers with other bytes (a new revision of the model)."""
    import numpy as np

    shapes = llama_shapes(**spec)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # 256 MiB of random bf16 bit patterns (exponents kept sane), sliced at varying offsets.
    pool = rng.integers(0x3C00, 0x3F80, size=128 * MiB, dtype=np.uint16)
    pool |= (rng.integers(0, 2, size=pool.size, dtype=np.uint16) << 15).astype(np.uint16)
    pool_bytes = memoryview(pool.view(np.uint8))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n

    def fill(fh: Any, shard: list[tuple[str, list[int]]]) -> None:
        cursor = 0
        for k, (_name, shape) in enumerate(shard):
            n = 2
            for d in shape:
                n *= d
            left = n
            cursor = (cursor + 4096 * (k + 1)) % (len(pool_bytes) // 2)
            while left:
                take = min(left, len(pool_bytes) - cursor)
                fh.write(pool_bytes[cursor : cursor + take])
                left -= take
                cursor = 0 if left else cursor + take

    from weightcache.testing.checkpoints import write_bf16_files

    t0 = time.perf_counter()
    total = write_bf16_files(path, [[(n, list(s)) for n, s in shard] for shard in shards],
                             config={"tie_word_embeddings": spec["tied"]}, data=fill,
                             index=True, fresh=False)
    return {"bytes": total, "tensors": len(shapes), "files": len(shards),
            "write_seconds": round(time.perf_counter() - t0, 2)}


# -- environment ----------------------------------------------------------------------------
def environment(workdir: Path) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name(0),
    }
    with contextlib.suppress(Exception):
        import cuda.bindings

        env["cuda_bindings"] = cuda.bindings.__version__
    with contextlib.suppress(Exception):
        import safetensors

        env["safetensors"] = safetensors.__version__
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pci.bus_id",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True)
        env["nvidia_smi"] = out.stdout.strip()
    with contextlib.suppress(Exception):
        cu = _driver()
        cu.cuInit(0)
        _, version = cu.cuDriverGetVersion()
        env["cuda_driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
    usage = shutil.disk_usage(workdir)
    env["disk_free_gb"] = round(usage.free / GB, 1)
    with contextlib.suppress(OSError):
        env["mem_total_gb"] = round(
            int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / GB, 1
        )
    return env


def _driver():
    from cuda.bindings import driver

    return driver


def nvml_process_bytes(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    return sum((p.usedGpuMemory or 0) for p in procs if p.pid == pid)


# -- measurements -------------------------------------------------------------------------
def _files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def _warm(files: list[Path]) -> float:
    """Read the files once so they sit in the page cache; returns the read rate (GB/s)."""
    t0 = time.perf_counter()
    total = 0
    buf = bytearray(64 * MiB)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total / (time.perf_counter() - t0) / GB


def time_load_file(files: list[Path]) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    total = 0
    for f in files:
        tensors = load_file(str(f), device="cuda:0")
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    torch.cuda.empty_cache()
    return {"seconds": round(dt, 3), "gb_per_s": round(total / dt / GB, 2)}


def timed_threads(worker: Any, count: int) -> float:
    """Seconds for `count` threads running `worker` to all finish."""
    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(count)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def raw_read_rate(files: list[Path], threads: int, direct: bool, chunk: int = 64 * MiB,
                  backward: bool = True) -> dict[str, Any]:
    """Disk (or page cache) read rate alone: parallel large reads, no GPU involved; the jobs
    are taken from the last file's end (`backward`, the device read's order) or from the
    first file's start."""
    import numpy as np

    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    if not backward:
        jobs.reverse()  # popped from the end: front to back
    lock = threading.Lock()
    total = [0]

    def worker() -> None:
        buf = np.empty(chunk + 4096, dtype=np.uint8)
        addr = buf.ctypes.data
        start = (-addr) % 4096
        view = memoryview(buf)[start : start + chunk]
        fds: dict[Path, int] = {}
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            while True:
                with lock:
                    if not jobs:
                        break
                    f, off = jobs.pop()
                if f not in fds:
                    fds[f] = os.open(f, flags)
                n = os.preadv(fds[f], [view], off)
                with lock:
                    total[0] += n
        finally:
            for fd in fds.values():
                os.close(fd)

    dt = timed_threads(worker, threads)
    return {"threads": threads, "direct": direct, "chunk_mib": chunk // MiB,
            "backward": backward, "seconds": round(dt, 3),
            "gb_per_s": round(total[0] / dt / GB, 2)}


def h2d_rate(nbytes: int = 4 << 30) -> dict[str, Any]:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 3
    return {"gb_per_s": round(nbytes / dt / GB, 2)}


def pin_rate(nbytes: int = 256 * MiB) -> dict[str, Any]:
    """Cost of allocating fresh pinned host memory (what the cold loader pays up front)."""
    import torch

    t0 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dt = time.perf_counter() - t0
    del buf
    return {"bytes": nbytes, "seconds": round(dt, 4), "gb_per_s": round(nbytes / dt / GB, 2)}


def d2d_rate(nbytes: int = 8 << 30) -> dict[str, Any]:
    """Device clone rate of a large buffer (bytes read + written counted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    src.fill_(3)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 5
    return {"copy_tb_per_s_rw": round(2 * nbytes / dt / 1e12, 2)}


def coldload_runs(model: Path, configs: list[dict[str, Any]], cold: bool) -> list[dict]:
    """The daemon's loader filling a VMM arena, in this process (no daemon start costs)."""
    import torch

    from weightcache.native.shared.checkpoint import open_checkpoint, tied_aliases
    from weightcache.native.shared.coldload import drop_page_cache, load_layout
    from weightcache.native.shared.loader import plan_layout
    from weightcache.native.shared.sharding import parse_rules
    from weightcache.native.shared.transport import get_transport

    ckpt = open_checkpoint(model)
    layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0,
                         aliases=tied_aliases(ckpt))
    out = []
    for cfg in configs:
        if cold:
            drop_page_cache(ckpt.files)
        else:
            _warm(ckpt.files)
        t0 = time.perf_counter()
        arena = get_transport("cuda_vmm").allocate(layout.nbytes, torch.device("cuda", 0))
        t_alloc = time.perf_counter() - t0
        stats = load_layout(layout, arena.tensor(), **cfg)
        total = time.perf_counter() - t0
        arena.close()
        torch.cuda.empty_cache()
        row = {**stats.as_dict(), "alloc_seconds": round(t_alloc, 3),
               "total_seconds": round(total, 3),
               "total_gb_per_s": round(layout.nbytes / total / GB, 2)}
        out.append(row)
    return out


def first_json_line(proc: subprocess.Popen, prefix: str) -> dict[str, Any]:
    """The JSON after `prefix` on the first stdout line that has it ({} if the process ends)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    proc.wait()
    return {}


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL after `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class DaemonProc:
    def __init__(self, model: Path, socket_dir: Path, transport: str) -> None:
        cmd = [sys.executable, "-m", "weightcache.native.daemon", "--model", str(model),
               "--device", "cuda", "--device-index", "0", "--transport", transport,
               "--weight-cache-socket-dir", str(socket_dir)]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.info = first_json_line(self.proc, "SERVING ")
        self.wall = time.perf_counter() - self.t0
        if not self.info:
            raise RuntimeError(f"daemon exited with {self.proc.returncode} before serving")

    def stop(self) -> None:
        stop_process(self.proc)


def _free() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def attach_runs(model: Path, daemon: DaemonProc, repeats: int) -> dict[str, Any]:
    """Zero-copy attaches through the client library, then one copy-mode attach."""
    import torch

    from weightcache.native.engine.attach import attach

    sock = daemon.info["socket"]
    nbytes = daemon.info["bytes"]
    times = []
    free_before = _free()
    delta = None
    for i in range(repeats + 1):
        res = attach(model, device="cuda:0", socket_path=sock, mode="zero_copy", fallback=False)
        if res.source != "cache":
            raise RuntimeError(f"attach fell back: {res.reason}")
        if i == 0:
            delta = free_before - _free()
            held_client = nvml_process_bytes(os.getpid())
            held_daemon = nvml_process_bytes(daemon.proc.pid)
            first_ms = res.seconds * 1e3
            # Device clone of the mapped arena: the copy-mode rate without protocol costs.
            flat = next(iter(res.state_dict.values()))
            base = torch.empty(0, dtype=torch.uint8, device=flat.device)
            base.set_(flat.untyped_storage())  # the whole mapped arena, as bytes
            clones = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                c = base.clone()
                torch.cuda.synchronize()
                clones.append(time.perf_counter() - t0)
                del c
            del base, flat
        else:
            times.append(res.seconds * 1e3)
        del res
    clone_s = statistics.median(clones[1:])
    driver_ms = transport_attach_ms(model, sock, repeats=5)
    t0 = time.perf_counter()
    res = attach(model, device="cuda:0", socket_path=sock, mode="copy", fallback=False)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    ok_copy = res.source == "cache"
    del res
    torch.cuda.empty_cache()
    return {
        "attach_first_ms": round(first_ms, 2),
        "transport_attach_ms_median": driver_ms,
        "attach_ms_median": round(statistics.median(times), 2),
        "attach_ms_min": round(min(times), 2),
        "attach_ms_max": round(max(times), 2),
        "repeats": repeats,
        "client_free_delta_bytes": delta,
        "client_nvml_bytes": held_client,
        "daemon_nvml_bytes": held_daemon,
        "arena_bytes": nbytes,
        "clone_seconds": round(clone_s, 4),
        "clone_tb_per_s": round(nbytes / clone_s / 1e12, 3),
        "clone_tb_per_s_rw": round(2 * nbytes / clone_s / 1e12, 3),
        "copy_mode_end_to_end_s": round(copy_s, 4),
        "copy_mode_gb_per_s": round(nbytes / copy_s / GB, 1),
        "copy_mode_source_cache": ok_copy,
    }


def transport_attach_ms(model: Path, sock: str, repeats: int) -> float:
    """Median time of the transport's attach alone (driver import/map/open), protocol excluded."""
    import contextlib as _cl

    import torch

    from weightcache.native.engine.attach import connect, plan_rank, request
    from weightcache.native.shared.transport import get_transport

    plan = plan_rank(model, device=torch.device("cuda", 0), device_index=0, tp_size=1,
                     tp_rank=0, shard_rules=None, dtype="auto")
    times = []
    for _ in range(repeats):
        with _cl.closing(connect(sock)) as conn:
            reply, fds = request(conn, "get_state", accept_fds=True, fingerprint=plan.fingerprint)
            meta = reply["arena"]
            transport = get_transport(meta["transport"])
            t0 = time.perf_counter()
            imported = transport.attach(meta, fds, torch.device("cuda", 0))
            imported.tensor()  # cuda_vmm maps when first used
            times.append((time.perf_counter() - t0) * 1e3)
            imported.close()
            del imported
    return round(statistics.median(times), 3)


def bench_model(name: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from weightcache.native.shared.coldload import drop_page_cache

    spec = MODELS[name]
    model = workdir / name
    result: dict[str, Any] = {"model": name}
    log(f"[{name}] writing checkpoint")
    result["checkpoint"] = write_checkpoint(model, spec)
    files = _files(model)
    nbytes = result["checkpoint"]["bytes"]
    log(f"[{name}] {nbytes / GB:.2f} GB in {len(files)} files")
    if args.attach_only:
        return attach_only(name, model, files, result, args)

    # Baseline: what a restart pays today.
    result["page_cache_warm_read_gb_per_s"] = round(_warm(files), 2)
    result["load_file_warm"] = time_load_file(files)
    log(f"[{name}] load_file warm {result['load_file_warm']}")
    if not args.skip_cold:
        result["drop_caches_global"] = drop_page_cache(files)
        result["load_file_cold"] = time_load_file(files)
        log(f"[{name}] load_file cold {result['load_file_cold']}")

    _warm(files)
    result["raw_read_warm_buffered"] = raw_read_rate(files, 16, False)
    quick = args.quick
    log(f"[{name}] page cache read, 16 threads {result['raw_read_warm_buffered']}")
    warm_cfgs = [dict(threads=8, chunk=16 * MiB), dict(threads=16, chunk=16 * MiB),
                 dict(threads=8, chunk=64 * MiB)]
    if quick:
        warm_cfgs = warm_cfgs[1:2]
    result["coldload_warm"] = coldload_runs(model, warm_cfgs, cold=False)
    log(f"[{name}] coldload warm {result['coldload_warm']}")
    if not args.skip_cold:
        cold_cfgs = [dict(threads=8, chunk=16 * MiB, direct=False),
                     dict(threads=8, chunk=16 * MiB, direct=True),
                     dict(threads=16, chunk=64 * MiB, direct=True)]
        if quick:
            cold_cfgs = cold_cfgs[2:]
        result["coldload_cold"] = coldload_runs(model, cold_cfgs, cold=True)
        log(f"[{name}] coldload cold {result['coldload_cold']}")
        drop_page_cache(files)
        result["raw_read_cold_direct"] = raw_read_rate(files, 16, True)
        drop_page_cache(files)
        result["raw_read_cold_buffered"] = (
            result["raw_read_cold_direct"] if quick else raw_read_rate(files, 16, False)
        )
        log(f"[{name}] raw read direct {result['raw_read_cold_direct']}"
            f" buffered {result['raw_read_cold_buffered']}")

    # The real daemon: cold then warm page cache, VMM; then legacy IPC.
    sockroot = Path(tempfile.mkdtemp(prefix="wc-bench-"))
    daemons: dict[str, Any] = {}
    if not args.skip_cold:
        drop_page_cache(files)
        d = DaemonProc(model, sockroot / "cold", "cuda_vmm")
        daemons["vmm_cold"] = {"load_seconds": d.info["load_seconds"],
                               "wall_to_serving_s": round(d.wall, 3)}
        d.stop()
    _warm(files)
    for transport in ("cuda_vmm", "cuda_ipc"):
        free0 = _free()
        d = DaemonProc(model, sockroot / transport, transport)
        try:
            row = {"load_seconds": d.info["load_seconds"], "wall_to_serving_s": round(d.wall, 3),
                   "daemon_free_delta_bytes": free0 - _free()}
            row.update(attach_runs(model, d, args.repeats))
        finally:
            d.stop()
        daemons[f"{'vmm' if transport == 'cuda_vmm' else 'legacy_ipc'}_warm"] = row
        log(f"[{name}] daemon {transport}: {row}")
    result["daemon"] = daemons
    shutil.rmtree(sockroot, ignore_errors=True)
    result["summary"] = summarize(result, nbytes)
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    return result


def attach_only(name: str, model: Path, files: list[Path], result: dict[str, Any],
                args: argparse.Namespace) -> dict[str, Any]:
    """Only the daemons (page cache warm) and the attaches, for re-measuring one transport."""
    sockroot = Path(tempfile.mkdtemp(prefix="wc-bench-"))
    _warm(files)
    result["daemon"] = {}
    for transport in args.transports.split(","):
        d = DaemonProc(model, sockroot / transport, transport)
        try:
            row = {"load_seconds": d.info["load_seconds"], "wall_to_serving_s": round(d.wall, 3)}
            row.update(attach_runs(model, d, args.repeats))
        finally:
            d.stop()
        result["daemon"][transport] = row
        log(f"[{name}] daemon {transport}: {row}")
    shutil.rmtree(sockroot, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    return result


def summarize(r: dict[str, Any], nbytes: int) -> dict[str, Any]:
    s: dict[str, Any] = {"gb": round(nbytes / GB, 2)}
    lf_warm = r["load_file_warm"]["seconds"]
    s["load_file_warm_s"] = lf_warm
    best_warm = min(r["coldload_warm"], key=lambda x: x["total_seconds"])
    s["coldload_warm_s"] = best_warm["total_seconds"]
    s["coldload_warm_gb_per_s"] = best_warm["total_gb_per_s"]
    s["page_cache_read_gb_per_s"] = r["raw_read_warm_buffered"]["gb_per_s"]
    if "load_file_cold" in r:
        best_cold = min(r["coldload_cold"], key=lambda x: x["total_seconds"])
        s["load_file_cold_s"] = r["load_file_cold"]["seconds"]
        s["coldload_cold_s"] = best_cold["total_seconds"]
        s["coldload_cold_gb_per_s"] = best_cold["total_gb_per_s"]
        s["cold_speedup_vs_load_file"] = round(r["load_file_cold"]["seconds"]
                                               / best_cold["total_seconds"], 2)
        s["disk_read_gb_per_s"] = max(r["raw_read_cold_direct"]["gb_per_s"],
                                      r["raw_read_cold_buffered"]["gb_per_s"])
    for key in ("vmm_warm", "legacy_ipc_warm"):
        d = r["daemon"].get(key)
        if d:
            s[f"{key}_attach_ms"] = d["attach_ms_median"]
            s[f"{key}_vs_load_file_warm"] = round(lf_warm * 1e3 / d["attach_ms_median"], 1)
            s[f"{key}_client_added_bytes"] = d["client_free_delta_bytes"]
            s[f"{key}_clone_tb_per_s"] = d["clone_tb_per_s"]
    return s


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache bench --device cuda",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="1b,8b", help="comma list of 1b, 8b, 32g")
    p.add_argument("--workdir", default=None, help="where checkpoints are written")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-cold", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep generated checkpoints")
    p.add_argument("--attach-only", action="store_true",
                   help="skip the load baselines: daemons and attaches only")
    p.add_argument("--transports", default="cuda_vmm,cuda_ipc")
    p.add_argument("--quick", action="store_true",
                   help="one loader setting per page-cache state (for the large shapes)")
    add_smoke_flag(p)
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench --device cuda needs a CUDA device")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="wc-bench-models-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"section": "gpu", "environment": environment(workdir),
                              "targets": TARGETS, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                          time.gmtime())}
    log(f"environment {json.dumps(report['environment'])}")
    report["bounds"] = {"pin_alloc": pin_rate(), "h2d_pinned": h2d_rate(), "d2d": d2d_rate()}
    log(f"bounds {report['bounds']}")
    torch.cuda.empty_cache()
    report["models"] = []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        name = ALIASES.get(key, key)
        spec = MODELS[name]
        need = sum(2 * _numel(s) for s in llama_shapes(**spec).values())
        if shutil.disk_usage(workdir).free < need * 1.1:
            report["models"].append({"model": name, "skipped": f"needs {need / GB:.0f} GB disk"})
            continue
        try:
            report["models"].append(bench_model(name, workdir, args))
        except Exception as exc:  # one failing shape must not lose the others' results
            report["models"].append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            log(f"[{name}] failed: {exc}")
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return report


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def print_table(report: dict[str, Any]) -> None:
    print("\n== gpu ==")
    for m in report["models"]:
        if "summary" not in m:
            print(m)
            continue
        print(f"{m['model']}: " + json.dumps(m["summary"]))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.models = os.environ.get("WEIGHTCACHE_BENCH_GPU_MODELS", args.models)
    args.out = args.out or os.environ.get("WEIGHTCACHE_BENCH_GPU_OUT") or None
    args.workdir = args.workdir or os.environ.get("WEIGHTCACHE_BENCH_GPU_WORKDIR") or None
    args.quick = (args.quick or args.smoke
                  or os.environ.get("WEIGHTCACHE_BENCH_GPU_QUICK", "") == "1")
    if args.smoke:
        args.models, args.repeats = "1b", 3
    only = os.environ.get("WEIGHTCACHE_BENCH_GPU_ATTACH_ONLY") == "1"
    args.attach_only = args.attach_only or only
    args.transports = os.environ.get("WEIGHTCACHE_BENCH_GPU_TRANSPORTS", args.transports)
    if args.device != "cuda":
        print("  skipped: the gpu section runs with --device cuda", flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("  skipped: no CUDA device", flush=True)
        return 0
    report = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
