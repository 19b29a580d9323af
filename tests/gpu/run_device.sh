#!/usr/bin/env bash
# Run the GPU tests and/or the GPU benchmark on a CUDA machine, logging under $OUT.
#   tests/gpu/run_device.sh [tests] [bench MODELS] [update SIZE] [load] [attach] [restart SIZE] [probe] [probe_staging] [probe_copy] [probe_pin] [probe_ready_start] [probe_import_order] [probe_prefetch_gil] [probe_tp_early] [probe_torchfree] [probe_readsize] [probe_first_attach]
#   e.g.  tests bench 1b,8b update 8b     or     restart 8b
# Works from a plain checkout (no install): it needs only the machine's python3 with torch,
# safetensors, msgpack and cuda-python.
set -u
OUT=${OUT:-/tmp/wc-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# Make `weightcache.agent` / `weightcache.operator` importable from the checkout itself (the
# folders are mapped into one namespace by setup.py; here two symlinks do the same). The
# checkout root itself must never be on sys.path: its operator/ would shadow the stdlib.
ln -sfn ../agent weightcache/agent
ln -sfn ../operator weightcache/operator
trap 'rm -f weightcache/agent weightcache/operator' EXIT
SHIM=/tmp/wc-shim
rm -rf "$SHIM"; mkdir -p "$SHIM"; ln -s "$ROOT/weightcache" "$SHIM/weightcache"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# The content digest's hash (BLAKE3) is a wheel the device's python may lack: a carried copy
# (`.wheels/`, run with carry: [".wheels"]) is unpacked onto the same path.
if ! python3 -c "import blake3" 2>/dev/null; then
  for w in "$ROOT"/.wheels/blake3-*.whl; do
    [ -f "$w" ] && python3 -m zipfile -e "$w" "$SHIM"
  done
fi
# Bytecode ahead of time, as an installed wheel has it (pip compiles at install): otherwise,
# with PYTHONDONTWRITEBYTECODE, every process compiles each module it imports, and a module
# first imported by an attach (a transport) is compiled on that attach's clock.
python3 -m compileall -q -j 0 weightcache >/dev/null 2>&1 || true

{
  echo "== environment $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  uname -a; nproc; free -g; df -h / /tmp /dev/shm 2>/dev/null
  command -v unshare && unshare --version
  python3 - <<'EOF'
import importlib, sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for m in ("cuda.bindings", "safetensors", "msgpack", "pynvml", "numpy", "blake3"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "MISSING", exc)
from cuda.bindings import driver as cu
cu.cuInit(0)
print("cuDriverGetVersion", cu.cuDriverGetVersion())
EOF
} 2>&1 | tee "$OUT/environment.txt"

# One of tests/gpu's probes: `probe NAME [SCRATCH]` runs tests/gpu/NAME.py with PROBE_OUT set to
# $OUT/NAME.json and its output teed to $OUT/NAME.log; with SCRATCH, PROBE_DIR names that folder
# for the probe's files, removed afterwards.
probe() {
  local name=$1 scratch=${2:-}
  (
    if [ -n "$scratch" ]; then mkdir -p "$scratch"; export PROBE_DIR=$scratch; fi
    PROBE_OUT="$OUT/$name.json" timeout "${BENCH_TIMEOUT:-300}" python3 "tests/gpu/$name.py" \
      2>&1 | tee "$OUT/$name.log"
  )
  if [ -n "$scratch" ]; then rm -rf "$scratch"; fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      shift
      WEIGHTCACHE_ISOLATION_REPORT="$OUT/isolation.json" timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest \
        -p no:cacheprovider --confcutdir=tests/gpu -o addopts="" -v -s -rA ${PYTEST_ARGS:-tests/gpu} \
        2>&1 | tee "$OUT/tests_gpu.log"
      ;;
    bench)
      MODELS=${2:-1b}; shift 2 || shift
      WORK=/var/tmp/wc-bench; mkdir -p "$WORK"
      WEIGHTCACHE_BENCH_GPU_MODELS="$MODELS" WEIGHTCACHE_BENCH_GPU_OUT="$OUT/bench_gpu.json" \
        WEIGHTCACHE_BENCH_GPU_WORKDIR="$WORK" \
        timeout "${BENCH_TIMEOUT:-540}" python3 -m weightcache.cli bench --device cuda gpu 2>&1 | tee "$OUT/bench_gpu.log"
      rm -rf "$WORK"
      ;;
    update)
      # In-place update vs rolling restart (weightcache/bench/update_vs_restart.py): two revisions of one
      # shape, e.g. `update 8b` (2 x 16 GB on disk).
      SIZE=${2:-8b}; shift 2 || shift
      WORK=/var/tmp/wc-update; mkdir -p "$WORK"
      timeout "${BENCH_TIMEOUT:-540}" python3 -m weightcache.bench.update_vs_restart --device cuda \
        --size "$SIZE" --workdir "$WORK" --out "$OUT/bench_update.json" 2>&1 | tee "$OUT/bench_update.log"
      rm -rf "$WORK"
      ;;
    load)
      # `weightcache bench --device cuda load`: layouts x (bounds, baselines, loader, preload),
      # attach, restarts; LOAD_LAYOUTS / LOAD_PARTS / LOAD_GRID=1 narrow or widen it.
      shift
      WORK=/var/tmp/wc-load; mkdir -p "$WORK"
      WEIGHTCACHE_BENCH_LOAD_OUT="$OUT/bench_load.json" WEIGHTCACHE_BENCH_LOAD_WORKDIR="$WORK" \
        WEIGHTCACHE_BENCH_LOAD_LAYOUTS="${LOAD_LAYOUTS:-sharded,single,many}" \
        WEIGHTCACHE_BENCH_LOAD_PARTS="${LOAD_PARTS:-attach,restart,scaling}" \
        WEIGHTCACHE_BENCH_LOAD_PROFILE_GRID="${LOAD_GRID:-0}" \
        timeout "${BENCH_TIMEOUT:-540}" python3 -m weightcache.cli bench --device cuda load 2>&1 | tee "$OUT/bench_load.log"
      rm -rf "$WORK"
      ;;
    attach)
      # `weightcache bench --device cuda attach` (weightcache/bench/attach.py): the 291-tensor
      # 16 GB shard (median, first in process, plan, copy mode TB/s) and 300..100k tensors,
      # a new process's first load (fresh), on sparse checkpoints (nothing to write); ATTACH_PARTS
      # narrows it (shard,fresh,scaling).
      shift
      WORK=/var/tmp/wc-attach; mkdir -p "$WORK"
      WEIGHTCACHE_BENCH_ATTACH_OUT="$OUT/bench_attach.json" WEIGHTCACHE_BENCH_ATTACH_WORKDIR="$WORK" \
        WEIGHTCACHE_BENCH_ATTACH_PARTS="${ATTACH_PARTS:-shard,fresh,scaling}" \
        timeout "${BENCH_TIMEOUT:-300}" python3 -m weightcache.cli bench --device cuda attach 2>&1 | tee "$OUT/bench_attach.log"
      rm -rf "$WORK"
      ;;
    restart)
      # `weightcache bench --device cuda restart` (weightcache/bench/restart.py): a transformers
      # engine restarting from the cache with torch.compile (none / plain cache dirs / AOT
      # precompile, first and second start), and a fresh node (daemon + engine started together
      # against the engine alone from disk). SIZE 8b (default) or 1b; RESTART_PARTS narrows it.
      SIZE=${2:-8b}; shift 2 || shift
      WORK=/var/tmp/wc-restart; rm -rf "$WORK"; mkdir -p "$WORK"
      WEIGHTCACHE_BENCH_RESTART_OUT="$OUT/bench_restart.json" WEIGHTCACHE_BENCH_RESTART_WORKDIR="$WORK" \
        WEIGHTCACHE_BENCH_RESTART_MODEL="$SIZE" \
        WEIGHTCACHE_BENCH_RESTART_PARTS="${RESTART_PARTS:-compile,fresh}" \
        timeout "${BENCH_TIMEOUT:-570}" python3 -m weightcache.cli bench --device cuda restart 2>&1 | tee "$OUT/bench_restart.log"
      rm -rf "$WORK"
      ;;
    probe)
      # tests/gpu/probe_io.py: the digest's scaling with threads per chunk size, and how reads
      # in the background slow a cold `import torch`; PROBE_PARTS narrows it (hash,contend).
      shift
      WORK=/var/tmp/wc-probe; rm -rf "$WORK"; mkdir -p "$WORK"
      timeout "${BENCH_TIMEOUT:-300}" python3 tests/gpu/probe_io.py "$WORK" "$OUT/probe_io.json" \
        $(echo "${PROBE_PARTS:-hash,contend}" | tr , ' ') 2>&1 | tee "$OUT/probe_io.log"
      rm -rf "$WORK"
      ;;
    probe_staging)
      # tests/gpu/probe_staging.py: fresh against reused host memory, the staging read, and
      # registering a read-only mapping of the file itself (PROBE_GB, default 8).
      shift
      probe probe_staging /var/tmp/wc-probe-staging
      ;;
    probe_copy)
      # tests/gpu/probe_copy.py: copy mode's driver calls (import, map, access, unmap) and the
      # copy queued a piece at a time as each piece is mapped (PROBE_GB, default 15).
      shift
      probe probe_copy
      ;;
    probe_pin)
      # tests/gpu/probe_pin.py: whether setting up the fill's pinned buffers stalls the O_DIRECT
      # reads beside it, and what would not (PROBE_GB of file, default 12; PROBE_CASES).
      shift
      probe probe_pin /var/tmp/wc-probe-pin
      ;;
    probe_ready_start)
      # tests/gpu/probe_ready_start.py: READY with the model cold, this tree against the base
      # tree in PROBE_BASE (a directory with a `weightcache` package; e.g. `.bench-base`,
      # carried), alternated, with the start's marks and the driver's start time.
      shift
      [ -n "${PROBE_BASE:-}" ] && python3 -m compileall -q -j 0 "$PROBE_BASE/weightcache" >/dev/null 2>&1
      probe probe_ready_start /var/tmp/wc-ready-start
      ;;
    probe_torchfree)
      # tests/gpu/probe_torchfree.py: a torch-free child's read + digest + copy of the 8B
      # checkpoint with every cache dropped, in turn with `weightcache preload` (PROBE_ROUNDS).
      shift
      probe probe_torchfree /var/tmp/wc-torchfree
      ;;
    probe_readsize)
      # tests/gpu/probe_readsize.py: a cold file read with the fill's pattern and the device
      # read's, and others (readers x MiB, either direction), in turn (PROBE_ROUNDS, PROBE_GB).
      shift
      probe probe_readsize /var/tmp/wc-readsize
      ;;
    probe_first_attach)
      # tests/gpu/probe_first_attach.py: a new process's first attach of the 16 GB shard, with
      # and without the driver bindings imported first, the bindings' own costs, a profile.
      shift
      probe probe_first_attach /var/tmp/wc-first-attach
      ;;
    probe_import_order)
      # tests/gpu/probe_import_order.py: a cold import set read in the recorded order and in
      # the disk's physical order (FIEMAP), alternated PROBE_ROUNDS times (default 3); no GPU.
      shift
      probe probe_import_order /var/tmp/wc-order
      ;;
    probe_prefetch_gil)
      # tests/gpu/probe_prefetch_gil.py: the import set's read alone, beside `import torch`, and
      # beside a thread that holds the GIL, PROBE_ROUNDS times (default 2); no GPU.
      shift
      timeout "${BENCH_TIMEOUT:-300}" python3 tests/gpu/probe_prefetch_gil.py \
        "$OUT/probe_prefetch_gil.json" "${PROBE_ROUNDS:-2}" 2>&1 | tee "$OUT/probe_prefetch_gil.log"
      ;;
    probe_tp_early)
      # tests/gpu/probe_tp_early.py: READY of a preload over every GPU (tensor-parallel) with
      # the checkpoint cold, the ranks' early reads on and off in turn (PROBE_ROUNDS, PROBE_GB).
      shift
      PROBE_DIR=/var/tmp PROBE_OUT="$OUT/probe_tp_early.json" timeout "${BENCH_TIMEOUT:-500}" \
        python3 tests/gpu/probe_tp_early.py cuda "$(nvidia-smi -L | wc -l)" "${PROBE_ROUNDS:-3}" \
        "${PROBE_GB:-16}" 2>&1 | tee "$OUT/probe_tp_early.log"
      ;;
    *) echo "unknown step $1"; shift ;;
  esac
done
