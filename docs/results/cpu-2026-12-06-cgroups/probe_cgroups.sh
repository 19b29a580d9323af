#!/usr/bin/env bash
# A rank's early reads inside a memory cgroup limited to LIMIT_MIB (no swap), sized the way a
# rank sizes them now (cgroups.available_memory) and the way it did before (the node's
# MemAvailable / 4), against a sparse checkpoint file three times the limit; then what a
# process in a cgroup of half a CPU, and one pinned to one core, size their pools to.
# Needs root and a writable cgroup v1 or v2 hierarchy. Run from the repository root:
#   bash docs/results/cpu-2026-12-06-cgroups/probe_cgroups.sh
set -u
PY=${PY:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-160}
"$PY" - "$LIMIT_MIB" <<'PYEOF'
import json, os, subprocess, sys, tempfile, uuid
from pathlib import Path
from weightcache.native.shared import cgroups
limit = int(sys.argv[1]) << 20
chain, version = cgroups.groups("memory")
child = chain[0] / f"wc-probe-{uuid.uuid4().hex[:8]}"
child.mkdir()
if version == 2:
    (child / "memory.max").write_text(str(limit)); (child / "memory.swap.max").write_text("0")
else:
    (child / "memory.limit_in_bytes").write_text(str(limit))
    if (child / "memory.memsw.limit_in_bytes").exists():
        (child / "memory.memsw.limit_in_bytes").write_text(str(limit))
code = r'''
import json, sys, time
from weightcache.native.shared import cgroups, earlyread
path, how = sys.argv[1], sys.argv[2]
node = cgroups.node_available()
budget = earlyread.default_budget(1) if how == "now" else min(earlyread.MAX_BUDGET, node // 4)
t = time.perf_counter()
early = earlyread.EarlyReads([path], budget, direct=True, threads=4).start()
early.join()
print(json.dumps({"how": how, "budget_mib": budget >> 20, "read_mib": early.stop()["read_bytes"] >> 20,
                  "node_available_mib": node >> 20, "seconds": round(time.perf_counter() - t, 3)}))
'''
with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(tmp) / "model.safetensors"
    with open(ckpt, "wb") as fh:
        fh.truncate(3 * limit)
    print(f"cgroup v{version} {child} limit {limit >> 20} MiB, file {3 * limit >> 20} MiB (sparse)")
    for how in ("now", "before"):
        out = subprocess.run(["sh", "-c", f'echo $$ > "{child}/cgroup.procs" && exec "$0" "$@"',
                              sys.executable, "-c", code, str(ckpt), how],
                             capture_output=True, text=True, timeout=120)
        print(how, "exit", out.returncode, out.stdout.strip() or out.stderr.strip()[-300:])
child.rmdir()
cpu = cgroups.groups("cpu")
cchild = cpu[0][0] / f"wc-probe-{uuid.uuid4().hex[:8]}"
cchild.mkdir()
if cpu[1] == 2:
    (cchild / "cpu.max").write_text("50000 100000")
else:
    (cchild / "cpu.cfs_period_us").write_text("100000"); (cchild / "cpu.cfs_quota_us").write_text("50000")
show = ("import json, os; from weightcache.native.shared import cgroups, coldload; "
        "print(json.dumps({'os_cpu_count': os.cpu_count(), 'quota': cgroups.cpu_quota(), "
        "'usable_cpus': cgroups.usable_cpus(), 'fill_cpu_slots_of_32': coldload.cpu_slots(32)}))")
out = subprocess.run(["sh", "-c", f'echo $$ > "{cchild}/cgroup.procs" && exec "$0" "$@"',
                      sys.executable, "-c", show], capture_output=True, text=True, timeout=120)
print("half a CPU:", out.stdout.strip() or out.stderr[-300:])
cchild.rmdir()
out = subprocess.run([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0}); " + show],
                     capture_output=True, text=True, timeout=120)
print("pinned to CPU 0:", out.stdout.strip() or out.stderr[-300:])
PYEOF
