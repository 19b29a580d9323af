"""Section `load`: cold and warm load, attach and engine restart on real checkpoint layouts.

On CUDA, a Llama-3.1-8B-shaped `LlamaForCausalLM` (random bf16 weights, built on the GPU) is
written in
three layouts users have: `save_pretrained` shards with an index (`sharded`), one large
`model.safetensors` (`single`), and one file per tensor with an index (`many`). For each, with
the page cache dropped and then warm, in the same run:
- the bounds: `cat` of the files (one sequential reader) and 16 threads of 64 MiB O_DIRECT
  reads; the device's sequential read bandwidth is the better of the two;
- the baselines: safetensors `load_file(device="cuda")`, transformers `from_pretrained`, in
  this process (torch imported already), and, against READY with every cache dropped, each
  in a fresh process from its spawn to the weights on the device (`*_process_cold`: its
  interpreter, imports and CUDA start included, as READY includes the rank's);
- the cold loader in this process, and the real `weightcache preload` (to READY), with the
  checkpoint's disk sampled meanwhile (`disk_timeline`; the summary's `*_disk_short_s` is the
  disk time READY lacked against the device read's rate), and what the launcher's and the
  rank's main threads waited on (`waits`, waits.py; the summary's `*_start_waits` is the
  rank's start by class);
then, on `sharded`: READY warm twice (the first after a device read that dropped every
cache, so the rank's libraries come from disk; the second as a warm node's restart, against
a fresh process's `load_file` with everything in memory), attach through the public client
(zero copy, and copy end to end), a cProfile of the attach, attach time against tensor count
and shard size (sparse files, up to 64 GB), and engine restarts (`weightcache.bench.restart`)
from the cache and from disk.
Figures are reported as ratios against those baselines; targets are shown, never asserted.
The content digest's own cost (`hash`: GB/s on one core and on all of them) is measured first.

With `--device cpu` the same sections run against a memfd arena (a smaller Llama shape; tiny
with `--smoke`, which CI runs): device read, `load_file`, `from_pretrained`, the in-process
loader, `weightcache preload` cold and warm with READY's phases, on the three layouts. Attach,
copy, restart and scaling stay CUDA-only. Cold steps on CPU evict only the checkpoint's files
(`posix_fadvise(DONTNEED)`), never the whole page cache of a shared machine.
Environment: WEIGHTCACHE_BENCH_LOAD_{LAYOUTS,OUT,WORKDIR,PARTS,PROFILE_GRID} (with OUT, every
step's whole result is also appended to `OUT.steps.jsonl` as it ends); PARTS is a comma
list of attach, restart, scaling (CUDA), readgrid (the device read, the loader and READY
with the model cold at 64 MiB reads and with 16 readers, and noyield), noyield (READY with
the model cold and the disk's share off, `WEIGHTCACHE_LOAD_YIELD=off`), afterset (READY
cold, with every cache dropped and with the model cold, the rank's early reads waiting for
its import set's read, `WEIGHTCACHE_EARLY_READS_WAIT=1`, the default until run96, then the
default, beside it and gentle until it is read, with the model cold again), noearly
(READY cold again with the rank's early reads off, `WEIGHTCACHE_LOAD_EARLY_MIB=0`: what
reading while the rank starts saves) and warmgrid (the warm preload again with 32 readers,
against the warm default of one per core), hotstep (the warm preload with the fill's hash
pieces of 16 MiB and of 4 MiB, in turn, twice: `WEIGHTCACHE_LOAD_HOT_STEP_MIB`; the default
is 16 from 8 CPU slots up),
plainprefetch (READY with every cache dropped
again, the rank's import set read ahead the earlier way: 8 readers, one read at a time, no
lookups; `WEIGHTCACHE_IMPORT_SET_PREFETCH=plain`), stopearly (READY with the model cold
again, the early reads stopping when the fill begins, `WEIGHTCACHE_EARLY_READS_BESIDE_FILL=0`,
then the default with the model cold again), census (READY with the model cold after an engine's
cold start: every cache dropped, then a fresh process that imports torch and transformers and
starts the device, the page cache a restart finds; the default, then without the import set's
warm verdict, `WEIGHTCACHE_IMPORT_SET_WARM=0`, then the default again), fillreads (READY with
the model cold, the early readers reading for the fill the jobs it reaches before any early
read began them, `WEIGHTCACHE_EARLY_READS_FOR_FILL=1`, against the default, the fill reading
them itself, in turn: asked, the default, asked, after the layout's own model-cold READY),
readjobs (READY with the model cold, the early reads one job per call while the rank starts,
`WEIGHTCACHE_EARLY_READ_JOBS=1`, against the default, in turn likewise), startgentle (READY
with the model cold, the rank's reads gentle for their first half second although its import
set settled the share, `WEIGHTCACHE_LOAD_START_GENTLE_S=0.5`, against the default, full reads
at once, in turn likewise), groupbeside (READY with the model cold, the early reads 4 jobs
per call beside the fill too, `WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL=4`, against the
default, one job per call once the fill began, in turn likewise), headstart (READY with the
model cold, the launcher's head start off, `WEIGHTCACHE_LOAD_HEAD_START_MIB=0`, against the
default, in turn likewise), holdab (READY with every
cache dropped, the disk share as before, `WEIGHTCACHE_LOAD_HOLD_MAX_S=1`
`WEIGHTCACHE_LOAD_YIELD_READS=0` or the knobs `WEIGHTCACHE_BENCH_SHARE_BEFORE` names, and as it
is, in turn, twice), importab (READY with every cache dropped, torch imported once the
rank's import set is read, the default, the set read in a process of its own beside the
import, `WEIGHTCACHE_IMPORT_SET_PROCESS=1`, and the set read on the rank's threads beside
the import, `WEIGHTCACHE_IMPORT_SET_WAIT=0`, in turn, twice), dropab (READY with every cache
dropped, the default and each variant `WEIGHTCACHE_BENCH_DROP_AB` names, in turn, for
`WEIGHTCACHE_BENCH_DROP_ROUNDS` rounds, each round starting one further along: a knob's A/B
where it matters most, with enough samples to tell tenths of a second), seed (READY
with every cache dropped as a node's first start again, with no import set of its own but
the seed an agent image carries, `weightcache import-set record` run in a fresh process, named by
`WEIGHTCACHE_IMPORT_SET_SEED`; with lean: READY with every cache dropped as a first start with
no set, with the seed, and with the node's own set, twice in turn), and lean
(only the two device reads, READY with the model cold and the other parts' model-cold A/Bs: a
short GPU call for a comparison; before them, where the node has no import set yet, one READY
that writes it; with hotstep: only the warm steps, their baselines and hotstep's READYs, no
cold step at all).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightcache.bench import gpu as g
from weightcache.bench.waits import StartWaits

GB = 1e9
MiB = 1 << 20
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
# Smaller shapes for CPU runs: about 0.9 GB, and a few MB at --smoke.
LLAMA_CPU = {**LLAMA_8B, "hidden_size": 1024, "intermediate_size": 3584,
             "num_hidden_layers": 16, "vocab_size": 32000}
LLAMA_SMOKE = {**LLAMA_8B, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
TARGETS = {"cold_vs_device_read_min": 0.95, "warm_gb_per_s_min": 15.0,
           "attach_ms_max": 10.0, "copy_tb_per_s_min": 1.5}
DEVICE = "cuda"  # set by main: "cuda" or "cpu"


def _cuda() -> bool:
    return DEVICE == "cuda"


def _sync() -> None:
    if _cuda():
        import torch

        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


_STEPS: dict[str, str | None] = {"layout": None}  # the layout being measured, for the steps file


def _safe(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """One failing measurement must not lose the others."""
    try:
        out = fn(*args, **kw)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"  {name}: {json.dumps(out)[:400]}")
    if report := os.environ.get("WEIGHTCACHE_BENCH_LOAD_OUT"):
        # Every step whole, as it ends: a run cut short (a device call's limit) keeps them all,
        # where the report itself is written once per layout.
        with open(f"{report}.steps.jsonl", "a") as fh:
            fh.write(json.dumps({"layout": _STEPS["layout"], "step": name, "result": out}) + "\n")
    return out


# -- checkpoints ----------------------------------------------------------------------------
def build_model(shape: dict[str, Any] = LLAMA_8B) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def write_layout(model: Any, kind: str, path: Path, limit_gb: float | None) -> dict[str, Any]:
    from safetensors.torch import save_file

    from weightcache.testing.checkpoints import sync_files

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    if kind == "sharded":
        # 4 shards of the 8B shape; on CPU as many of the smaller shapes.
        shard = "5GB" if _cuda() else f"{max(1, model.num_parameters() * 2 // 4 // MiB)}MB"
        model.save_pretrained(path, max_shard_size=shard)
    else:
        model.config.save_pretrained(path)
        state = {}
        total = 0
        for k, v in model.state_dict().items():  # the first `limit_gb` of tensors
            if limit_gb is not None and total + v.nbytes > limit_gb * GB:
                break
            state[k] = v.detach()
            total += v.nbytes
        if kind == "single":
            save_file({k: v.cpu() for k, v in state.items()}, str(path / "model.safetensors"),
                      metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, (k, v) in enumerate(state.items()):
                fname = f"model-{i + 1:05d}-of-{len(state):05d}.safetensors"
                save_file({k: v.cpu()}, str(path / fname), metadata={"format": "pt"})
                weight_map[k] = fname
            index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())},
                     "weight_map": weight_map}
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sync_files(path)
    files = g._files(path)
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "write_seconds": round(time.perf_counter() - t0, 2)}


# -- measurements ---------------------------------------------------------------------------
def drop(files: list[Path], everything: bool = True) -> None:
    """Evict the checkpoint; on the GPU box (ours alone) with `everything` the whole page cache
    too, so the rank's own imports come from the disk as on a node that never ran one."""
    from weightcache.native.shared.coldload import drop_page_cache

    drop_page_cache(files, everything=everything and _cuda())  # CI's machine is shared


def hash_figures(smoke: bool) -> dict[str, Any]:
    """The content digest's cost: GB/s of its hash over content chunks, one core and all."""
    from concurrent.futures import ThreadPoolExecutor

    from weightcache.native.shared import content

    size = (16 if smoke else 512) * MiB
    data = memoryview(os.urandom(MiB) * (size // MiB))
    step = content.CHUNK_BYTES
    chunks = [data[i : i + step] for i in range(0, size, step)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        if n == 1:
            for c in chunks:
                content.chunk_digest(c)
        else:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(content.chunk_digest, chunks, chunksize=16))
        return size / (time.perf_counter() - t0) / GB

    cores = os.cpu_count() or 1
    one = max(run(1) for _ in range(3))
    every = max(run(cores) for _ in range(3))
    return {"hash": content.HASH, "chunk_kib": step // 1024, "cores": cores,
            "one_core_gb_per_s": round(one, 2), "all_cores_gb_per_s": round(every, 2),
            "one_core_seconds_per_gb": round(1 / one, 3),
            "cores_for_15_gb_per_s": round(15 / one, 1)}


def load_file_once(files: list[Path]) -> dict[str, Any]:
    """safetensors `load_file` onto the device; on CPU its lazy mmap is cloned (bytes read)."""
    import torch
    from safetensors.torch import load_file

    _sync()
    t0 = time.perf_counter()
    total = 0
    for f in files:
        tensors = load_file(str(f), device="cuda:0" if _cuda() else "cpu")
        if not _cuda():
            tensors = {k: v.clone() for k, v in tensors.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    _sync()
    dt = time.perf_counter() - t0
    if _cuda():
        torch.cuda.empty_cache()
    return {"seconds": round(dt, 3), "gb_per_s": round(total / dt / GB, 2)}


def loader_runs(model: Path, configs: list[dict[str, Any]], cold: bool) -> list[dict]:
    """The daemon's loader, with the digest, filling this device's arena in this process."""
    import torch

    from weightcache.native.shared.checkpoint import open_checkpoint, tied_aliases
    from weightcache.native.shared.loader import load_into_arena, plan_layout
    from weightcache.native.shared.sharding import parse_rules
    from weightcache.native.shared.transport import default_transport

    ckpt = open_checkpoint(model)
    layout = plan_layout(ckpt, rules=parse_rules(None), tp_size=1, tp_rank=0,
                         aliases=tied_aliases(ckpt))
    device = torch.device("cuda", 0) if _cuda() else torch.device("cpu")
    out = []
    for cfg in configs:
        if cold:
            drop(ckpt.files)
        else:
            g._warm(ckpt.files)
        t0 = time.perf_counter()
        arena = default_transport(device).allocate(layout.nbytes, device)
        t_alloc = time.perf_counter() - t0
        with _knobs(cfg):
            stats = load_into_arena(layout, arena.tensor(), digest=list(ckpt.files),
                                    direct=cfg.get("direct"))
        total = time.perf_counter() - t0
        arena.close()
        if _cuda():
            torch.cuda.empty_cache()
        out.append({**stats.as_dict(), "alloc_seconds": round(t_alloc, 3),
                    "total_seconds": round(total, 3),
                    "total_gb_per_s": round(layout.nbytes / total / GB, 2)})
    return out


@contextlib.contextmanager
def _knobs(cfg: dict[str, Any]) -> Any:
    """A loader config's threads and read size, through the knobs the loader reads."""
    from weightcache.native.shared import loadenv

    env = {}
    if "threads" in cfg:
        env[loadenv.THREADS_ENV] = str(cfg["threads"])
    if "chunk" in cfg:
        env[loadenv.CHUNK_ENV] = str(cfg["chunk"] // MiB)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cat_read(files: list[Path]) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", *map(str, files)], stdout=null, check=True)
    dt = time.perf_counter() - t0
    n = sum(f.stat().st_size for f in files)
    return {"seconds": round(dt, 3), "gb_per_s": round(n / dt / GB, 3)}


def from_pretrained(path: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    _sync()
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                             device_map=DEVICE if _cuda() else None)
    _sync()
    dt = time.perf_counter() - t0
    n = sum(p.numel() * p.element_size() for p in m.parameters())
    del m
    if _cuda():
        torch.cuda.empty_cache()
    return {"seconds": round(dt, 3), "gb_per_s": round(n / dt / GB, 3)}


class Launcher:
    """The real `weightcache preload` (launcher + one daemon rank), timed to its READY line."""

    def __init__(self, model: Path, sockdir: Path, env: dict[str, str] | None = None,
                 device: str | None = None, waits: bool = False) -> None:
        cmd = [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(model),
               "--device", device or DEVICE, "--weight-cache-socket-dir", str(sockdir)]
        self.t0 = time.perf_counter()
        self.spawned_at = time.monotonic()  # the clock of READY's `marks`
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        sampler = StartWaits(self.proc.pid, self.t0) if waits else None
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.ready = g.first_json_line(self.proc, "READY ")
        self.wall = time.perf_counter() - self.t0
        self.waits = sampler.stop(self._start_ended()) if sampler is not None else None
        if not self.ready:
            raise RuntimeError(f"preload exited {self.proc.returncode}: {self.stderr[-5:]}")

    def _start_ended(self) -> float | None:
        """When, from the spawn, the rank's start phase ended: READY less the phases after
        it (READY's relay, a few ms, counts as the rank's)."""
        phases = _rank0(self.ready or {}).get("phases")
        if not isinstance(phases, dict) or "startup_seconds" not in phases:
            return None
        after = sum(v for k, v in phases.items()
                    if k != "startup_seconds" and isinstance(v, (int, float)))
        return self.wall - after

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    @property
    def socket(self) -> str:
        return self.ready["sockets"][0]

    def summary(self) -> dict[str, Any]:
        progress = [ln for ln in self.stderr if ln.startswith("preload ")]
        return {"wall_to_ready_s": round(self.wall, 3), "ready": self.ready,
                "progress_lines": progress[:3] + progress[-2:],
                "start_marks": start_marks(self.ready, self.spawned_at)}

    def stop(self) -> None:
        g.stop_process(self.proc)


class DiskTimeline:
    """The checkpoint's block device, sampled while READY comes (`/sys/dev/block/M:m/stat`):
    what it read in each BIN_S and the reads it had in flight, so a READY that trails the
    device read shows where the disk stood idle or ran short of reads."""

    BIN_S = 0.25

    def __init__(self, path: Path, interval: float = 0.05) -> None:
        st = os.stat(path)
        self.stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (seconds, sectors read, in flight)
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="disk-timeline", daemon=True)
        if self._read() is not None:
            self._thread.start()

    def _read(self) -> tuple[int, int] | None:
        try:
            if self.stat.exists():
                fields = self.stat.read_text().split()
                return int(fields[2]), int(fields[8])
            # An overlay or other virtual file system: every physical disk, summed.
            sectors = flight = 0
            for line in Path("/proc/diskstats").read_text().splitlines():
                f = line.split()
                if Path(f"/sys/block/{f[2]}/device").exists():
                    sectors, flight = sectors + int(f[5]), flight + int(f[11])
            return sectors, flight
        except (OSError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._read()
            if got is None:
                return
            self.samples.append((time.perf_counter() - self._t0, *got))
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any] | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if len(self.samples) < 2:
            return None
        bins: dict[int, list[Any]] = {}
        for (_, s0, _), (t1, s1, q1) in zip(self.samples, self.samples[1:], strict=False):
            b = bins.setdefault(int(t1 / self.BIN_S), [0, 0, 0])
            b[0] += (s1 - s0) * 512
            b[1] += q1
            b[2] += 1
        rows = []
        for k in range(max(bins) + 1):
            read, flight, n = bins.get(k, (0, 0, 1))  # a bin with no sample read nothing
            rows.append([round(k * self.BIN_S, 2), round(read / self.BIN_S / GB, 2),
                         round(flight / n, 1)])
        return {"bin_s": self.BIN_S, "columns": ["t_s", "gb_per_s", "in_flight"], "rows": rows}


def preload_once(model: Path, files: list[Path], cold: bool | str, env: dict | None = None
                 ) -> dict:
    """READY of a real `weightcache preload`; `cold`: True drops every cache, "model" only the
    checkpoint's pages (a node whose agent already ran: its libraries are in memory)."""
    if cold:
        drop(files, everything=cold is True)
    else:
        g._warm(files)
    sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
    timeline = DiskTimeline(files[0]) if cold else None
    try:
        launcher = Launcher(model, sockdir, env, waits=bool(cold))
    finally:
        disk = timeline.stop() if timeline is not None else None
    try:
        summary = launcher.summary()
        if disk is not None:
            summary["disk_timeline"] = disk
        if launcher.waits is not None:
            summary["waits"] = launcher.waits
        _wait_for_import_set(env)
        return summary
    finally:
        launcher.stop()
        shutil.rmtree(sockdir, ignore_errors=True)


def record_seed(seed: Path) -> dict[str, Any]:
    """The seed an agent image carries, written to `seed` by `weightcache import-set record` in
    a fresh process, as the image's build runs it; its summary line. This process has torch
    loaded: the pages it maps cannot be dropped, so the seed names more than an image's build
    would record (docs/results/cpu-2026-12-06-seed), and a seeded start reads more than a real
    one."""
    recorded = subprocess.run([sys.executable, "-m", "weightcache.cli", "import-set", "record",
                               str(seed)], capture_output=True, text=True, timeout=300)
    if recorded.returncode != 0:
        raise RuntimeError(f"import-set record: {recorded.stderr[-500:]}")
    return json.loads(recorded.stdout)


def seeded_first_start(model: Path, files: list[Path], found: Path) -> dict:
    """READY with every cache dropped on a node with no import set of its own but the agent
    image's seed (`record_seed`). The node's set (`found`) is put back afterwards, so the
    steps after this one start as they would have."""
    seed = found.with_name("import-set.seed.json")
    recorded = record_seed(seed)
    kept = found.with_name(f"{found.name}.kept")
    had = found.exists()
    if had:
        os.replace(found, kept)
    try:
        out = preload_once(model, files, True, {"WEIGHTCACHE_IMPORT_SET_SEED": str(seed)})
        out["seed"] = recorded
        return out
    finally:
        if had:
            os.replace(kept, found)
        else:
            found.unlink(missing_ok=True)


def _import_set(env: dict[str, str] | None = None) -> Path | None:
    value = (env or {}).get("WEIGHTCACHE_IMPORT_SET") or os.environ.get("WEIGHTCACHE_IMPORT_SET")
    return Path(value) if value and value != "off" else None


def _wait_for_import_set(env: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
    """A rank writes its import set just after READY; a daemon that lives on always gets
    there, a benchmark's is stopped at once: give it the moment it needs (the set the READY's
    own `env` named, else this process's). Waiting on another path than the rank's let a
    probe stop every rank before it wrote its set (2026-12-05: each READY then started as a
    node's first)."""
    path = _import_set(env)
    deadline = time.monotonic() + timeout_s
    while path is not None and not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def attach_figures(model: Path, sock: str, repeats: int, fresh_runs: int = 3) -> dict[str, Any]:
    """Public-client attaches (zero copy), a breakdown, and a cProfile of a few."""
    from pathlib import Path as P

    import torch

    from weightcache.native.engine import attach as client

    dev = torch.device("cuda", 0)
    from weightcache.testing.processes import run_attach

    # A restarting engine's very first attach: a fresh process (lazy imports, first driver
    # calls), as `weightcache attach` reports it, three times.
    fresh = [run_attach(["--model", str(model), "--device", "cuda:0", "--socket-path", sock,
                         "--no-fallback"])["seconds"] for _ in range(fresh_runs)]
    t0 = time.perf_counter()
    client.attach(model, device="cuda:0", socket_path=sock, fallback=False)
    first = time.perf_counter() - t0
    totals, plans, caches = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = client.attach(model, device="cuda:0", socket_path=sock, fallback=False)
        totals.append(time.perf_counter() - t0)
        assert res.source == "cache", res.reason
        del res
        t0 = time.perf_counter()
        plan = client.plan_rank(model, device=dev, device_index=0, tp_size=1, tp_rank=0,
                                shard_rules=None, dtype="auto")
        t1 = time.perf_counter()
        _, state, *_ = client._from_cache(plan, P(sock), mode="zero_copy", tp_size=1,
                                         tp_rank=0, connect_timeout_s=5, state_timeout_s=60)
        t2 = time.perf_counter()
        plans.append(t1 - t0)
        caches.append(t2 - t1)
        del state
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        client.attach(model, device="cuda:0", socket_path=sock, fallback=False)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    return {"fresh_process_first_attach_ms": [round(x * 1e3, 2) for x in fresh],
            "first_in_process_ms": round(first * 1e3, 2), "attach_ms_median": ms(totals),
            "attach_ms_min": round(min(totals) * 1e3, 3),
            "attach_ms_max": round(max(totals) * 1e3, 3), "plan_rank_ms_median": ms(plans),
            "from_cache_ms_median": ms(caches), "repeats": repeats,
            "driver_attach_ms_median": g.transport_attach_ms(model, sock, 5),
            "profile": text.getvalue()[:6000]}


def copy_figure(model: Path, sock: str, nbytes: int) -> dict[str, Any]:
    import torch

    from weightcache.native.engine import attach as client

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = client.attach(model, device="cuda:0", socket_path=sock, fallback=False, mode="copy")
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = res.source == "cache"
    del res
    torch.cuda.empty_cache()
    return {"seconds": round(dt, 4), "tb_per_s": round(nbytes / dt / 1e12, 3), "cache": ok}


def sparse_checkpoint(path: Path, tensors: int, nbytes: int) -> Path:
    """A safetensors file of `tensors` bf16 tensors totalling ~`nbytes`, data left as a hole.

    Attach time depends on the table and the mapping, not on the values: a sparse file makes
    a 64 GB shard possible on a 64 GB disk (reading a hole returns zeros without I/O).
    """
    from weightcache.testing.checkpoints import write_bf16_files

    per = max(1, nbytes // tensors // 2 // 4096 * 4096)  # elements per tensor
    write_bf16_files(path, [[(f"model.layers.{i}.w.weight", [per // 1024, 1024])
                             for i in range(tensors)]], config={})
    return path


def attach_scaling(workdir: Path) -> list[dict[str, Any]]:
    """Attach time against tensor count (16 GB) and against size (300 tensors)."""
    grid = [(3000, 16), (300, 64)]  # with the real 291-tensor 16 GB shard of `sharded`
    rows = []
    for tensors, gb in grid:
        path = sparse_checkpoint(workdir / f"sparse-{tensors}-{gb}", tensors, int(gb * GB))
        sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
        try:
            launcher = Launcher(path, sockdir)
            try:
                a = attach_figures(path, launcher.socket, 10, fresh_runs=0)
                a.pop("profile", None)
                rows.append({"tensors": tensors, "gb": gb, **a,
                             "load_seconds": launcher.ready.get("load_seconds")})
            finally:
                launcher.stop()
        except Exception as exc:
            rows.append({"tensors": tensors, "gb": gb, "error": f"{type(exc).__name__}: {exc}"})
        log(f"  attach scaling {rows[-1]}")
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
    return rows


def restart_figures(model: Path, files: list[Path]) -> dict[str, Any]:
    from weightcache.bench.restart import spawn

    out: dict[str, Any] = {}
    sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
    g._warm(files)
    launcher = Launcher(model, sockdir)
    try:
        out["cache"] = spawn("cache", model, launcher.socket)
        log(f"  restart cache {out['cache']}")
    finally:
        launcher.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
    for source, cold in (("disk", False), ("disk", True), ("from_pretrained", False),
                         ("from_pretrained", True)):
        if cold:
            drop(files)
        else:
            g._warm(files)
        key = f"{source}_{'cold' if cold else 'warm'}"
        out[key] = spawn(source, model, None)
        log(f"  restart {key} {out[key]}")
    return out


def measure_layout(kind: str, model_dir: Path, parts: set[str], grid: bool) -> dict[str, Any]:
    files = g._files(model_dir)
    r: dict[str, Any] = {}
    # `lean`: only the device reads, READY with the model cold and the parts' A/Bs (a GPU
    # call's minutes for the comparison itself).
    lean = "lean" in parts
    full = kind == "sharded" and not lean  # warm preload, cat and the grid on the main layout
    if lean and "hotstep" in parts:  # the warm fill's A/B alone: a GPU call's minute for it
        _warm_steps(r, kind, model_dir, files, parts)
        return _attach_restart_summary(r, kind, model_dir, files, parts)
    if full:
        drop(files)
        r["cat_cold"] = _safe("cat cold", cat_read, files)
    drop(files)
    r["direct_cold"] = _safe("32x64MiB O_DIRECT cold", g.raw_read_rate, files, 32, True)
    if not lean:
        _baselines_and_cold(r, model_dir, files, parts, grid, full)
    elif "seed" in parts and (found := _import_set()) is not None:
        _first_starts_in_turn(r, model_dir, files, found)
    elif (found := _import_set()) is not None and not found.exists():
        # The comparison's READYs are restarts: a node's first start writes the set first.
        r["preload_cold_model_first_start"] = _safe("preload, model cold, a node's first start",
                                                    preload_once, model_dir, files, "model")
    r["preload_cold_model"] = _safe("preload, model cold", preload_once, model_dir, files,
                                    "model")
    _model_cold_parts(r, model_dir, files, parts, full, grid)
    if "holdab" in parts:  # READY with every cache dropped, the disk share's two holds in turn
        before = share_before()
        for key in HOLD_READY:
            env = before if "holdbefore" in key else {}
            r[key] = _safe(key, preload_once, model_dir, files, True, env)
    if "importab" in parts and _import_set() is not None:  # the import after the set, in turn
        for key, env in IMPORT_READY.items():
            r[key] = _safe(key, preload_once, model_dir, files, True, env)
    if "dropab" in parts:  # knobs against the default, every cache dropped, in turn
        for key, env in drop_ab_steps(drop_ab(), drop_rounds()):
            r[key] = _safe(key, preload_once, model_dir, files, True, env)
    # The device read once more, after the cold steps: one read of a virtual disk varied by
    # up to a fifth between two reads of one run (run27: 9.41 s, the loader cold 8.06 s), so
    # READY is compared with the faster of the two.
    drop(files)
    r["direct_cold_again"] = _safe("32x64MiB O_DIRECT cold, again", g.raw_read_rate, files,
                                   32, True)
    if not lean:
        _warm_steps(r, kind, model_dir, files, parts)
    return _attach_restart_summary(r, kind, model_dir, files, parts)


def _first_starts_in_turn(r: dict[str, Any], model_dir: Path, files: list[Path],
                          found: Path) -> None:
    """`lean` with `seed`: READY with every cache dropped, twice each in turn, as a node's
    first start with no import set, as one with the agent image's seed, and as a later start
    with the node's own set (the one the first start wrote)."""
    for suffix in ("", "_again"):
        found.unlink(missing_ok=True)
        r[f"preload_cold_first_start{suffix}"] = _safe(
            "preload cold, a node's first start", preload_once, model_dir, files, True)
        r[f"preload_cold_seeded_first_start{suffix}"] = _safe(
            "preload cold, a node's first start with the image's seed", seeded_first_start,
            model_dir, files, found)
        r[f"preload_cold{suffix}"] = _safe("preload cold", preload_once, model_dir, files, True)


def _baselines_and_cold(r: dict[str, Any], model_dir: Path, files: list[Path], parts: set[str],
                        grid: bool, full: bool) -> None:
    """The in-process baselines and the loader cold, then READY with every cache dropped
    (a node's first start on the main layout), the fresh-process baselines, and the parts
    that run with every cache dropped."""
    drop(files)
    r["load_file_cold"] = _safe("load_file cold", load_file_once, files)
    drop(files)
    r["from_pretrained_cold"] = _safe("from_pretrained cold", from_pretrained, model_dir)
    cfgs: list[dict[str, Any]] = [{}]
    if grid:
        cfgs += [dict(threads=8, chunk=16 * MiB, direct=False),  # the old defaults
                 dict(threads=16, chunk=16 * MiB)]
    r["loader_cold"] = _safe("loader cold", loader_runs, model_dir, cfgs, True)
    # READY cold on every layout: the cache must beat from_pretrained on each of them. On the
    # main layout first as a node's very first start (no import set yet), then as any later
    # start of a node whose page cache was dropped (the set the earlier start wrote).
    # A node's first start on the main layout, or on whichever layout runs first when the
    # main one is not measured (every later cold start then has the set it wrote).
    if (found := _import_set()) is not None and (full or not found.exists()):
        found.unlink(missing_ok=True)
        r["preload_cold_first_start"] = _safe("preload cold, a node's first start",
                                              preload_once, model_dir, files, True)
    r["preload_cold"] = _safe("preload cold", preload_once, model_dir, files, True)
    if "seed" in parts and (found := _import_set()) is not None:  # a first start, seeded
        r["preload_cold_seeded_first_start"] = _safe(
            "preload cold, a node's first start with the image's seed", seeded_first_start,
            model_dir, files, found)
    if "plainprefetch" in parts and _import_set() is not None:  # the import set read as before
        for key, env in PLAIN_PREFETCH_READY.items():
            r[key] = _safe(key, preload_once, model_dir, files, True, env)
    # What a user does without the cache, as READY with every cache dropped does it: a fresh
    # interpreter that imports torch (and transformers) and loads, from a dropped page cache.
    for key, source in PROCESS_BASES.items():
        drop(files)
        r[key] = _safe(key, process_baseline, source, model_dir)
    if full and (grid or "noearly" in parts):  # without reading while the rank starts
        r["preload_cold_no_early"] = _safe("preload cold, early reads off", preload_once,
                                           model_dir, files, True,
                                           {"WEIGHTCACHE_LOAD_EARLY_MIB": "0"})


def _model_cold_parts(r: dict[str, Any], model_dir: Path, files: list[Path],
                      parts: set[str], full: bool, grid: bool) -> None:
    """The parts' A/Bs of READY with only the model cold (the rank's libraries in the page
    cache, as the baselines' own process has them), after the layout's own such READY."""
    if "census" in parts and _import_set() is not None:  # a restart's set, partly out
        for key, env in CENSUS_READY.items():
            r[f"{key}_engine_start"] = _safe(f"{key}: an engine's cold start first",
                                             engine_cold_start, model_dir, files)
            r[key] = _safe(key, preload_once, model_dir, files, "model", env)
    for part, runs in (("fillreads", FILL_READS_READY), ("readjobs", READ_JOBS_READY),
                       ("startgentle", START_GENTLE_READY),
                       ("groupbeside", GROUP_BESIDE_READY), ("headstart", HEAD_START_READY)):
        if part in parts:  # a knob's A/B, in turn with the default
            for key, env in runs.items():
                r[key] = _safe(key, preload_once, model_dir, files, "model", env)
    if "stopearly" in parts:  # the early reads stopped when the fill begins: the earlier way
        for key, env in STOP_EARLY_READY.items():
            r[key] = _safe(key, preload_once, model_dir, files, "model", env)
        r["preload_cold_model_again"] = _safe("preload, model cold, again", preload_once,
                                              model_dir, files, "model")
    if "readgrid" in parts:  # the read size: the device read and the fill at 16 and 64 MiB
        _read_grid(r, model_dir, files)
    if "readgrid" in parts or "noyield" in parts:  # what the disk's share costs READY
        for key, env in NOYIELD_READY.items():
            r[key] = _safe(key, preload_once, model_dir, files, "model", env)
    if "afterset" in parts and _import_set() is not None:
        for key, cold in AFTER_SET_READY.items():
            r[key] = _safe(key, preload_once, model_dir, files, cold, AFTER_SET_ENV)
        # The default once more, after them: what the order of the runs alone moves.
        r["preload_cold_model_again"] = _safe("preload, model cold, again", preload_once,
                                              model_dir, files, "model")
    if full and (grid or "noearly" in parts):
        r["preload_cold_model_no_early"] = _safe(
            "preload, model cold, early reads off", preload_once, model_dir, files, "model",
            {"WEIGHTCACHE_LOAD_EARLY_MIB": "0"})


def _warm_steps(r: dict[str, Any], kind: str, model_dir: Path, files: list[Path],
                parts: set[str]) -> None:
    """The warm baselines, the loader warm, and on `sharded` READY warm (twice)."""
    g._warm(files)
    r["load_file_warm"] = _safe("load_file warm", load_file_once, files)
    r["from_pretrained_warm"] = _safe("from_pretrained warm", from_pretrained, model_dir)
    r["loader_warm"] = _safe("loader warm", loader_runs, model_dir, [{}], False)
    if kind == "sharded":
        r["preload_warm"] = _safe("preload warm", preload_once, model_dir, files, False)
        # The step above starts after a device read that dropped every cache, so its rank's
        # libraries came from disk. A warm node's restart has them in memory as well: READY
        # again, against a fresh process's `load_file` with everything in memory too.
        r["preload_warm_again"] = _safe("preload warm, again (libraries in memory)",
                                        preload_once, model_dir, files, False)
        r["load_file_process_warm"] = _safe("load_file warm, fresh process", process_baseline,
                                            "load_file", model_dir)
        if "warmgrid" in parts:  # the warm default (a reader per core) against 32 readers
            r["preload_warm_threads32"] = _safe(
                "preload warm, 32 readers", preload_once, model_dir, files, False,
                {"WEIGHTCACHE_LOAD_THREADS": "32"})
        if "hotstep" in parts:  # the warm fill's hash piece, 16 MiB against 4 (coldload)
            for suffix in ("", "_again"):
                for mib in HOT_STEP_MIB:
                    r[f"preload_warm_hot_step{mib}{suffix}"] = _safe(
                        f"preload warm, {mib} MiB hash pieces", preload_once, model_dir,
                        files, False, {"WEIGHTCACHE_LOAD_HOT_STEP_MIB": str(mib)})


def _attach_restart_summary(r: dict[str, Any], kind: str, model_dir: Path, files: list[Path],
                            parts: set[str]) -> dict[str, Any]:
    nbytes = None
    with contextlib.suppress(Exception):
        nbytes = r["loader_warm"][0]["nbytes"]
    if kind == "sharded" and "attach" in parts and nbytes and _cuda():
        sockdir = Path(tempfile.mkdtemp(prefix="wc-sock-"))
        g._warm(files)
        try:
            launcher = Launcher(model_dir, sockdir)
            try:
                r["attach"] = _safe("attach", attach_figures, model_dir, launcher.socket, 20)
                r["copy"] = _safe("copy", copy_figure, model_dir, launcher.socket, nbytes)
            finally:
                launcher.stop()
        finally:
            shutil.rmtree(sockdir, ignore_errors=True)
    if kind == "sharded" and "restart" in parts and _cuda():
        r["restart"] = _safe("restart", restart_figures, model_dir, files)
    r["summary"] = summarize(r, nbytes)
    return r


def _read_grid(r: dict[str, Any], model_dir: Path, files: list[Path]) -> None:
    """Where the read size sets the disk's rate (it differs between machines of one kind):
    the device read with 16 MiB reads and with 16 readers, the loader and READY with 64 MiB."""
    drop(files)
    r["direct_cold_32x16mib"] = _safe("32x16MiB O_DIRECT cold", g.raw_read_rate, files, 32,
                                      True, 16 * MiB)
    drop(files)
    r["direct_cold_16x64mib"] = _safe("16x64MiB O_DIRECT cold", g.raw_read_rate, files, 16, True)
    r["loader_cold_64mib"] = _safe("loader cold, 64 MiB", loader_runs, model_dir,
                                   [dict(chunk=64 * MiB), dict(threads=16, chunk=64 * MiB)], True)
    for key, env in GRID_READY.items():
        r[key] = _safe(key, preload_once, model_dir, files, "model", env)


PROCESS_BASES = {"from_pretrained_process_cold": "from_pretrained",
                 "load_file_process_cold": "load_file"}
# What each fresh process runs: its imports, its CUDA start, the weights on the device.
_PROCESS_CODE = {
    "from_pretrained": (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "dev = sys.argv[2]\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,"
        " device_map=dev if dev == 'cuda' else None)\n"),
    "load_file": (
        "import pathlib, sys, torch\n"
        "from safetensors.torch import load_file\n"
        "dev = sys.argv[2]\n"
        "state = {}\n"
        "for f in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):\n"
        "    state.update(load_file(str(f), device=dev))\n"),
    # No weights: an engine's start before its load (the `census` part's restart).
    "engine_start": (
        "import sys, torch\n"
        "import transformers  # noqa: F401\n"
        "dev = sys.argv[2]\n"
        "torch.zeros(1, device=dev)\n"),
}


def process_baseline(source: str, model_dir: Path, timeout_s: float = 300) -> dict[str, Any]:
    """A fresh process' load, from its spawn to the weights on the device: its interpreter,
    imports and CUDA start included, as READY includes the rank's."""
    code = _PROCESS_CODE[source] + (
        "torch.cuda.synchronize() if dev == 'cuda' else None\n"
        "print('LOADED', flush=True)\n")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, str(model_dir), DEVICE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        seconds = time.perf_counter() - t0
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{source} in a fresh process: no result in {timeout_s} s") from None
    if line.strip() != "LOADED":
        raise RuntimeError(f"{source} in a fresh process: exit {proc.returncode}: {err[-800:]}")
    return {"seconds": round(seconds, 3)}


GRID_READY = {  # READY with the model cold, at another read size
    "preload_cold_model_chunk64": {"WEIGHTCACHE_LOAD_CHUNK_MIB": "64"},
    "preload_cold_model_chunk64_t16": {"WEIGHTCACHE_LOAD_CHUNK_MIB": "64",
                                       "WEIGHTCACHE_LOAD_THREADS": "16"},
}
NOYIELD_READY = {"preload_cold_model_noyield": {"WEIGHTCACHE_LOAD_YIELD": "off"}}
# The early reads after the import set's read instead of beside it (the default since run96):
# every cache dropped (True) and only the model cold ("model").
AFTER_SET_READY = {"preload_cold_afterset": True, "preload_cold_model_afterset": "model"}
AFTER_SET_ENV = {"WEIGHTCACHE_EARLY_READS_WAIT": "1"}
# READY with the model cold, the early reads stopped when the fill begins (earlyread.py).
STOP_EARLY_READY = {"preload_cold_model_stopearly": {"WEIGHTCACHE_EARLY_READS_BESIDE_FILL": "0"}}


def _in_turn(knob: str, default: str, env: dict[str, str]) -> dict[str, dict[str, str]]:
    """A knob's A/B with READY the model cold, in turn: the knob, the default, the knob again
    (after the layout's own model-cold READY, which is the default's first)."""
    return {f"preload_cold_model_{knob}": env, f"preload_cold_model_{default}_again": {},
            f"preload_cold_model_{knob}_again": env}


# The early readers reading for the fill the jobs it reaches before any early read began them
# (earlyread.py), against the default, the fill reading them itself.
FILL_READS_READY = _in_turn("forfill", "fillreads", {"WEIGHTCACHE_EARLY_READS_FOR_FILL": "1"})
# The early reads one job per call while the rank starts (earlyread.py: the earlier way),
# against the default, READ_JOBS per call.
READ_JOBS_READY = _in_turn("onejob", "readjobs", {"WEIGHTCACHE_EARLY_READ_JOBS": "1"})
# The rank's reads gentle for their first half second although its import set settled the
# share (the default until run50), against the default, full at once (diskshare.py).
START_GENTLE_READY = _in_turn("gentlestart", "startgentle",
                              {"WEIGHTCACHE_LOAD_START_GENTLE_S": "0.5"})
# READY with every cache dropped, the disk share as it was before (a fixed hold after another
# program's faults, faults only) and as it is (the hold grows, others' reads count:
# diskshare.HOLD_MAX, READ_FLOOR), in turn, twice. The restart bench's `holdab` compares the
# same two (share_before).
SHARE_BEFORE = {"WEIGHTCACHE_LOAD_HOLD_MAX_S": "1", "WEIGHTCACHE_LOAD_YIELD_READS": "0"}
SHARE_BEFORE_ENV = "WEIGHTCACHE_BENCH_SHARE_BEFORE"
HOLD_READY = ("preload_cold_holdbefore", "preload_cold_holdnow", "preload_cold_holdbefore_again",
              "preload_cold_holdnow_again")
# READY with every cache dropped, torch imported once the import set is read (the default,
# `WEIGHTCACHE_IMPORT_SET_WAIT=1`), the set read in a process of its own beside the import
# (`WEIGHTCACHE_IMPORT_SET_PROCESS=1`), and the set read on the rank's threads beside its
# import (`WEIGHTCACHE_IMPORT_SET_WAIT=0`, the default until runs 78-84), in turn, twice. Why:
# beside it, the import holds the GIL that the set's readers need between their system calls,
# and the early reads wait for the set (tests/gpu/probe_prefetch_gil.py). Each names its knobs,
# so that the comparison holds whatever the defaults.
IMPORT_AFTER = {"WEIGHTCACHE_IMPORT_SET_WAIT": "1", "WEIGHTCACHE_IMPORT_SET_PROCESS": "0"}
IMPORT_APART = {"WEIGHTCACHE_IMPORT_SET_WAIT": "0", "WEIGHTCACHE_IMPORT_SET_PROCESS": "1"}
IMPORT_BESIDE = {"WEIGHTCACHE_IMPORT_SET_WAIT": "0", "WEIGHTCACHE_IMPORT_SET_PROCESS": "0"}
IMPORT_READY = {f"preload_cold_import{label}{again}": env
                for again in ("", "_again")
                for label, env in (("after", IMPORT_AFTER), ("apart", IMPORT_APART),
                                   ("beside", IMPORT_BESIDE))}


DROP_AB_ENV = "WEIGHTCACHE_BENCH_DROP_AB"
DROP_ROUNDS_ENV = "WEIGHTCACHE_BENCH_DROP_ROUNDS"
DROP_ROUNDS = 3
MAX_DROP_ROUNDS = 16
DROP_PREFIX = "preload_cold_dropab_"


def _knob_pairs(name: str, text: str) -> dict[str, str]:
    """`NAME=VALUE` pairs, comma-separated, each NAME a load's knob (`WEIGHTCACHE_...`, never
    the bench's own); ValueError naming `name` otherwise."""
    pairs = [item.strip().partition("=") for item in text.split(",") if item.strip()]
    bad = [key for key, eq, value in pairs
           if not eq or not value.strip() or not key.strip().startswith("WEIGHTCACHE_")
           or key.strip().startswith("WEIGHTCACHE_BENCH_")]
    if bad or not pairs:
        raise ValueError(f"{name}={text!r}: use WEIGHTCACHE_...=VALUE pairs, comma-separated")
    return {key.strip(): value.strip() for key, _, value in pairs}


def drop_ab() -> list[dict[str, str]]:
    """The variants a `dropab` part compares with the default: `WEIGHTCACHE_BENCH_DROP_AB`,
    variants separated by `;`, each `NAME=VALUE` pairs (`_knob_pairs`)."""
    text = os.environ.get(DROP_AB_ENV, "").strip()
    if not text:
        raise ValueError(f"the dropab part needs {DROP_AB_ENV}, e.g. "
                         "WEIGHTCACHE_EARLY_READS_WAIT=0;WEIGHTCACHE_IMPORT_SET_THREADS=64")
    return [_knob_pairs(DROP_AB_ENV, part) for part in text.split(";") if part.strip()]


def drop_rounds() -> int:
    """`WEIGHTCACHE_BENCH_DROP_ROUNDS`: 1 to MAX_DROP_ROUNDS (default DROP_ROUNDS)."""
    text = os.environ.get(DROP_ROUNDS_ENV, "").strip()
    if not text:
        return DROP_ROUNDS
    if not text.isdigit() or not 1 <= int(text) <= MAX_DROP_ROUNDS:
        raise ValueError(f"{DROP_ROUNDS_ENV}={text!r}: use 1 to {MAX_DROP_ROUNDS}")
    return int(text)


def drop_ab_steps(variants: list[dict[str, str]], rounds: int
                  ) -> list[tuple[str, dict[str, str]]]:
    """(key, env) of every READY of a `dropab` part: per round the default (`default`) and each
    variant (`v1`, `v2`...), each round starting one further along, so that no variant always
    follows the same one (the page cache and the disk carry one READY into the next)."""
    arms = [("default", {})] + [(f"v{i}", env) for i, env in enumerate(variants, 1)]
    steps = []
    for n in range(rounds):
        for k in range(len(arms)):
            label, env = arms[(n + k) % len(arms)]
            steps.append((f"{DROP_PREFIX}{label}_{n + 1}", env))
    return steps


def drop_ab_summary(r: dict[str, Any], bound: float) -> dict[str, Any] | None:
    """Per arm of a `dropab` part (its knobs are `drop_ab()`'s, in order): each READY (s) in
    round order, of the faster device read, the early reads' first byte after the launcher's
    start, and the mean."""
    arms: dict[str, dict[str, Any]] = {}
    for key in sorted(k for k in r if k.startswith(DROP_PREFIX)):
        label, _, n = key[len(DROP_PREFIX):].rpartition("_")
        ready = _get(r, key, "ready")
        arm = arms.setdefault(label, {"ready_s": {}, "first_read_s": {}})
        if ready and ready.get("seconds"):
            arm["ready_s"][int(n)] = ready["seconds"]
            arm["first_read_s"][int(n)] = (_get(r, key, "start_marks") or {}).get(
                "early_first_read")
    if not arms:
        return None
    out = {}
    for label, arm in arms.items():
        order = sorted(arm["ready_s"])
        ready = [arm["ready_s"][n] for n in order]
        out[label] = {
            "ready_s": ready,
            "ready_vs_device_read": [round(bound / x, 3) for x in ready],
            "first_read_s": [arm["first_read_s"][n] for n in order],
            "mean_s": round(sum(ready) / len(ready), 3) if ready else None,
        }
    return out


def share_before() -> dict[str, str]:
    """The share a `holdab` part compares the default with: SHARE_BEFORE, or the knobs
    `WEIGHTCACHE_BENCH_SHARE_BEFORE` names (`NAME=VALUE` pairs, comma-separated; e.g.
    `WEIGHTCACHE_LOAD_HOLD_S=1` to compare a shorter hold after a blip with the old one)."""
    text = os.environ.get(SHARE_BEFORE_ENV, "").strip()
    return _knob_pairs(SHARE_BEFORE_ENV, text) if text else dict(SHARE_BEFORE)
# The early reads 64 MiB a call beside the fill too (earlyread.py), against the default, a
# job (16 MiB) a call once the fill began.
GROUP_BESIDE_READY = _in_turn("groupbeside", "besidejobs",
                              {"WEIGHTCACHE_EARLY_READ_JOBS_BESIDE_FILL": "4"})
# The launcher's head start off (headstart.py), against the default: the checkpoint's first
# 512 MiB asked of the disk before the rank runs.
HEAD_START_READY = _in_turn("nohead", "headstart", {"WEIGHTCACHE_LOAD_HEAD_START_MIB": "0"})
# READY with the model cold after an engine's cold start (importset.py's census): the default,
# without the warm verdict, the default again (what the order of the runs alone moves).
CENSUS_READY = {"preload_cold_model_restart": {},
                "preload_cold_model_restart_nowarm": {"WEIGHTCACHE_IMPORT_SET_WARM": "0"},
                "preload_cold_model_restart_again": {}}


def engine_cold_start(model_dir: Path, files: list[Path]) -> dict[str, Any]:
    """Every cache dropped (on CPU: the checkpoint's pages), then what an engine's start reads:
    a fresh process that imports torch and transformers and starts the device
    (`process_baseline`'s `engine_start`). The page cache it leaves holds the libraries' pages
    that this start faulted in, not every page the rank's own start did: a restart's."""
    drop(files)
    return process_baseline("engine_start", model_dir)


# READY with every cache dropped, the import set read ahead the earlier way (importset.py).
# `hotstep`: the warm fill's hash piece (WEIGHTCACHE_LOAD_HOT_STEP_MIB), in this order, twice.
HOT_STEP_MIB = (16, 4)
PLAIN_PREFETCH_READY = {"preload_cold_plain_prefetch": {"WEIGHTCACHE_IMPORT_SET_PREFETCH":
                                                        "plain"}}


def _get(d: dict, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


# The device read (32 x 64 MiB O_DIRECT) before READY's cold steps and after them: READY's
# bound is the faster (with `cat`, where it ran).
DEVICE_READS = ("direct_cold", "direct_cold_again")


def _rank0(ready: dict[str, Any]) -> dict[str, Any]:
    """READY's report of its first rank ({} when there is none)."""
    return (ready.get("rank_loads") or [{}])[0]


def _phases(ready: dict[str, Any]) -> dict[str, Any] | None:
    """READY's phases of the (first) rank: start-up, CUDA, plan, allocate, fill+digest...,
    and `outside_rank_seconds`: READY's seconds that none of them covers (the launcher's own
    start and checks before it spawns the rank, the rank's interpreter and module imports
    before its clock starts, and READY's relay)."""
    phases = _rank0(ready).get("phases")
    if not isinstance(phases, dict) or not isinstance(ready.get("seconds"), (int, float)):
        return phases
    covered = sum(v for v in phases.values() if isinstance(v, (int, float)))
    return {**phases, "outside_rank_seconds": round(ready["seconds"] - covered, 4)}


def start_marks(ready: dict[str, Any] | None, spawned_at: float) -> dict[str, float]:
    """When, in seconds from the launcher's spawn, READY's start passed each step, in order:
    the launcher's (`launcher_*`), its first rank's (`exec`, `run`, `input`, `locked`,
    `early_started`, `imported`, `serving`), the import set's read-ahead (`prefetch_*`: the
    end of its census, and `warm` where that let the early reads start before its read) and
    the early reads' first read asked for and landed (`early_first_*`). Up to
    `early_first_landed` the disk read nothing of the checkpoint: that is READY's lead over
    the device read. All are `time.monotonic()` readings of one clock (READY's `marks`)."""
    if not ready:
        return {}
    rank = _rank0(ready)
    found = {f"launcher_{k}": v for k, v in (ready.get("marks") or {}).items()}
    found.update(rank.get("marks") or {})
    for key, name in (("started_at", "prefetch_started"), ("census_at", "prefetch_census"),
                      ("warm_at", "prefetch_warm"), ("done_at", "prefetch_done")):
        found[name] = (rank.get("import_prefetch") or {}).get(key)
    for key, name in (("first_read_at", "early_first_read"),
                      ("first_landed_at", "early_first_landed")):
        found[name] = (rank.get("early") or {}).get(key)
    return dict(sorted(((k, round(v - spawned_at, 4)) for k, v in found.items()
                        if isinstance(v, (int, float))), key=lambda kv: kv[1]))


def _early(ready: dict[str, Any]) -> dict[str, Any] | None:
    """What the (first) rank read while it started, and how much of it the fill took."""
    return _rank0(ready).get("early")


def _disk(ready: dict[str, Any]) -> dict[str, Any] | None:
    """The (first) rank's share of the disk: gentle seconds, and whose faults made it so."""
    return (_rank0(ready).get("loader") or {}).get("disk")


def _start_waits(waits: dict[str, Any] | None, top: int = 8) -> dict[str, float] | None:
    """The rank's start by what it waited on (waits.py): its `top` classes, in seconds."""
    seconds = _get(waits or {}, "rank_start", "seconds")
    return dict(list(seconds.items())[:top]) if isinstance(seconds, dict) else None


def _disk_short(timeline: dict[str, Any] | None, r: dict[str, Any]) -> float | None:
    """Seconds of the device read's rate that READY's disk timeline lacks, summed over its
    bins (the disk idle, or reading slower than it can): where READY trails the device read."""
    rate = max((_get(r, key, "gb_per_s") or 0) for key in DEVICE_READS)
    if not timeline or not rate:
        return None
    return round(sum(timeline["bin_s"] * max(0.0, 1 - row[1] / rate)
                     for row in timeline["rows"]), 2)


def _rank_gb_per_s(ready: dict[str, Any], nbytes: int | None) -> float | None:
    """The slowest rank's fill rate of a READY, GB/s (None without bytes or seconds)."""
    seconds = max(ready.get("load_seconds") or [0])
    return round(nbytes / seconds / GB, 2) if nbytes and seconds else None


def summarize(r: dict[str, Any], nbytes: int | None) -> dict[str, Any]:
    s: dict[str, Any] = {}
    reads = [_get(r, key, "seconds") for key in DEVICE_READS]
    bound = min(x for x in (_get(r, "cat_cold", "seconds"), *reads, 1e9) if x)
    s["device_read_s"] = bound
    s["device_reads_s"] = reads  # the device read before the cold steps and after them
    loader = _get(r, "loader_cold")
    if isinstance(loader, list) and loader and "total_seconds" in loader[0]:
        s["loader_cold_s"] = loader[0]["total_seconds"]
        s["loader_cold_vs_device_read"] = round(bound / loader[0]["total_seconds"], 3)
    for key in ("load_file_cold", "from_pretrained_cold", "load_file_warm",
                "from_pretrained_warm", *PROCESS_BASES):
        v = _get(r, key, "seconds")
        if v:
            s[f"{key}_s"] = v
    pc = _get(r, "preload_cold", "ready")
    if pc:
        fill = max(pc.get("load_seconds") or [0])
        s["preload_cold_ready_s"] = pc.get("seconds")
        s["preload_cold_rank_load_s"] = fill
        s["preload_cold_ready_vs_device_read"] = round(bound / pc["seconds"], 3)
        s["preload_cold_phases"] = _phases(pc)
        for key in ("load_file_cold", "from_pretrained_cold", *PROCESS_BASES):
            if s.get(f"{key}_s"):
                s[f"preload_cold_ready_vs_{key}"] = round(s[f"{key}_s"] / pc["seconds"], 3)
    if (lost := _disk_short(_get(r, "preload_cold", "disk_timeline"), r)) is not None:
        s["preload_cold_disk_short_s"] = lost
    if pc:
        s["preload_cold_early"] = _early(pc)
        s["preload_cold_head_start"] = pc.get("head_start")
        s["preload_cold_import_prefetch"] = _rank0(pc).get("import_prefetch")
        s["preload_cold_disk"] = _disk(pc)
        s["preload_cold_start_waits"] = _start_waits(_get(r, "preload_cold", "waits"))
        s["preload_cold_start_marks"] = _get(r, "preload_cold", "start_marks")
        s["preload_cold_wall_to_ready_s"] = _get(r, "preload_cold", "wall_to_ready_s")
    for key in ("preload_cold_first_start", "preload_cold_seeded_first_start",
                "preload_cold_first_start_again", "preload_cold_seeded_first_start_again",
                "preload_cold_again", "preload_cold_no_early",
                "preload_cold_model", "preload_cold_model_no_early", *GRID_READY,
                *PLAIN_PREFETCH_READY, *STOP_EARLY_READY,
                *NOYIELD_READY, *AFTER_SET_READY, *CENSUS_READY, *FILL_READS_READY,
                *READ_JOBS_READY,
                *START_GENTLE_READY, *GROUP_BESIDE_READY, *HEAD_START_READY, *HOLD_READY,
                *IMPORT_READY, "preload_cold_model_again",
                *sorted(k for k in r if k.startswith(DROP_PREFIX))):
        pp = _get(r, key, "ready")
        if pp:
            s[f"{key}_ready_s"] = pp.get("seconds")
            s[f"{key}_ready_vs_device_read"] = round(bound / pp["seconds"], 3)
            s[f"{key}_phases"] = _phases(pp)
            s[f"{key}_early"] = _early(pp)
            s[f"{key}_head_start"] = pp.get("head_start")
            s[f"{key}_disk"] = _disk(pp)
            s[f"{key}_import_prefetch"] = _rank0(pp).get("import_prefetch")
            s[f"{key}_start_waits"] = _start_waits(_get(r, key, "waits"))
            s[f"{key}_start_marks"] = _get(r, key, "start_marks")
            s[f"{key}_wall_to_ready_s"] = _get(r, key, "wall_to_ready_s")
            if (lost := _disk_short(_get(r, key, "disk_timeline"), r)) is not None:
                s[f"{key}_disk_short_s"] = lost
            # The fresh processes start with every cache dropped: against those READYs only.
            fresh = () if "_model" in key else tuple(PROCESS_BASES)
            for base in ("load_file_cold", "from_pretrained_cold", *fresh):
                if s.get(f"{base}_s"):
                    s[f"{key}_ready_vs_{base}"] = round(s[f"{base}_s"] / pp["seconds"], 3)
    if (ab := drop_ab_summary(r, bound)) is not None:
        s["dropab"] = ab
    lw = _get(r, "loader_warm")
    if isinstance(lw, list) and lw and "total_gb_per_s" in lw[0]:
        s["loader_warm_gb_per_s"] = lw[0]["total_gb_per_s"]
    pw = _get(r, "preload_warm", "ready")
    if pw:
        s["preload_warm_rank_load_s"] = max(pw.get("load_seconds") or [0])
        if (rate := _rank_gb_per_s(pw, nbytes)) is not None:
            s["preload_warm_rank_gb_per_s"] = rate
        s["preload_warm_ready_s"] = pw.get("seconds")
        s["preload_warm_threads"] = (_rank0(pw).get("loader") or {}
                                     ).get("threads")
        p32 = _get(r, "preload_warm_threads32", "ready")
        if p32 and (rate := _rank_gb_per_s(p32, nbytes)) is not None:
            s["preload_warm_threads32_rank_gb_per_s"] = rate
        for mib in HOT_STEP_MIB:
            for suffix in ("", "_again"):
                key = f"preload_warm_hot_step{mib}{suffix}"
                hot = _get(r, key, "ready")
                if hot and (rate := _rank_gb_per_s(hot, nbytes)) is not None:
                    s[f"{key}_rank_gb_per_s"] = rate
        s["preload_warm_phases"] = _phases(pw)
        s["preload_warm_early"] = _early(pw)
    pa = _get(r, "preload_warm_again", "ready")
    if pa:
        s["preload_warm_again_ready_s"] = pa.get("seconds")
        if (rate := _rank_gb_per_s(pa, nbytes)) is not None:
            s["preload_warm_again_rank_gb_per_s"] = rate
        s["preload_warm_again_phases"] = _phases(pa)
        s["preload_warm_again_start_marks"] = _get(r, "preload_warm_again", "start_marks")
        base = _get(r, "load_file_process_warm", "seconds")
        if base and pa.get("seconds"):
            s["load_file_process_warm_s"] = base
            s["preload_warm_again_ready_vs_load_file_process_warm"] = round(
                base / pa["seconds"], 3)
    if _get(r, "attach", "attach_ms_median"):
        s["attach_ms_median"] = r["attach"]["attach_ms_median"]
        lf = s.get("load_file_warm_s")
        if lf:
            s["load_file_warm_vs_attach"] = round(lf * 1e3 / s["attach_ms_median"], 1)
    if _get(r, "copy", "tb_per_s"):
        s["copy_tb_per_s"] = r["copy"]["tb_per_s"]
    return s


def run(workdir: Path, layouts: list[str], parts: set[str], grid: bool,
        limit_gb: float | None = None, smoke: bool = False) -> dict[str, Any]:
    import torch
    import transformers

    report: dict[str, Any] = {"section": "load", "device": DEVICE, "targets": TARGETS,
                              "environment": _environment(workdir),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    report["environment"]["transformers"] = transformers.__version__
    log(f"environment {json.dumps(report['environment'])}")
    report["hash"] = _safe("content hash", hash_figures, smoke)
    if _cuda():
        report["bounds"] = {"pin_alloc": _safe("pin", g.pin_rate),
                            "h2d": _safe("h2d", g.h2d_rate)}
        torch.cuda.empty_cache()
    model = build_model(LLAMA_8B if _cuda() else LLAMA_SMOKE if smoke else LLAMA_CPU)
    report["layouts"] = {}
    # The socket directory of a node outlives its pods; here every preload has its own, so
    # the ranks' import set (importset.py) is kept in the work directory instead.
    os.environ.setdefault("WEIGHTCACHE_IMPORT_SET", str(workdir / "import-set.json"))
    for kind in layouts:
        path = workdir / f"llama8b-{kind}"
        log(f"[{kind}] writing")
        info = write_layout(model, kind, path, None if kind == "sharded" else limit_gb)
        log(f"[{kind}] {info}")
        if kind == layouts[-1]:
            del model
            if _cuda():
                torch.cuda.empty_cache()
        _STEPS["layout"] = kind
        report["layouts"][kind] = {"checkpoint": info,
                                   **measure_layout(kind, path, parts, grid and kind == "sharded")}
        log(f"[{kind}] summary {json.dumps(report['layouts'][kind]['summary'])}")
        shutil.rmtree(path, ignore_errors=True)
        if out := os.environ.get("WEIGHTCACHE_BENCH_LOAD_OUT"):
            Path(out).write_text(json.dumps(report, indent=2))
    if "scaling" in parts and _cuda():
        report["attach_scaling"] = attach_scaling(workdir)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return report


def _environment(workdir: Path) -> dict[str, Any]:
    if _cuda():
        return g.environment(workdir)
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release(), "cpus": os.cpu_count(), "device": "cpu (memfd)"}


def main(argv: list[str]) -> int:
    global DEVICE
    DEVICE = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
    smoke = "--smoke" in argv
    import torch

    if _cuda() and not torch.cuda.is_available():
        print("  skipped: no CUDA device", flush=True)
        return 0
    layouts = os.environ.get("WEIGHTCACHE_BENCH_LOAD_LAYOUTS", "sharded,single,many").split(",")
    parts = set(os.environ.get("WEIGHTCACHE_BENCH_LOAD_PARTS",
                               "attach,restart,scaling").split(","))
    grid = os.environ.get("WEIGHTCACHE_BENCH_LOAD_PROFILE_GRID", "0") == "1"
    if "holdab" in parts:
        share_before()  # a bad comparison is told before the first checkpoint is written
    if "dropab" in parts:
        drop_ab(), drop_rounds()
    workdir = Path(os.environ.get("WEIGHTCACHE_BENCH_LOAD_WORKDIR") or
                   tempfile.mkdtemp(prefix="wc-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    limit = os.environ.get("WEIGHTCACHE_BENCH_LOAD_SUBSET_GB")  # single/many: a smaller model
    report = run(workdir, [x for x in layouts if x], parts, grid, float(limit) if limit else None,
                 smoke)
    if out := os.environ.get("WEIGHTCACHE_BENCH_LOAD_OUT"):
        Path(out).write_text(json.dumps(report, indent=2))
    print("\n== load ==")
    print(f"hash: {json.dumps(report['hash'])}")
    for kind, r in report["layouts"].items():
        print(f"{kind}: {json.dumps(r['summary'])}")
    for row in report.get("attach_scaling", []):
        print("attach", {k: row.get(k) for k in ("tensors", "gb", "attach_ms_median",
                                                  "driver_attach_ms_median", "error")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
