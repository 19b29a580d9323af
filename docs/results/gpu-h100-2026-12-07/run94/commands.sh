R=/tmp/wcres94; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export WEIGHTCACHE_BENCH_DROP_AB="WEIGHTCACHE_EARLY_READS_WAIT=0;WEIGHTCACHE_IMPORT_SET_THREADS=96;WEIGHTCACHE_LOAD_HEAD_START_COLD=1"
export WEIGHTCACHE_BENCH_DROP_ROUNDS=3
OUT=$R/dropab LOAD_LAYOUTS=sharded LOAD_PARTS=lean,dropab BENCH_TIMEOUT=420 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "dropab done $(el)s"
python3 - $R/dropab/bench_load.json.steps.jsonl <<'PY'
import json, sys
dev = []
for line in open(sys.argv[1]):
    d = json.loads(line); r = d["result"] or {}
    if "O_DIRECT" in d["step"]:
        dev.append(r.get("seconds")); print(d["step"], r.get("seconds")); continue
    rd = r.get("ready") or {}
    if not rd: print(d["step"], "no ready", str(r)[:200]); continue
    rk = rd["rank_loads"][0]; m = r.get("start_marks") or {}; ip = rk.get("import_prefetch") or {}
    print(d["step"], rd.get("seconds"), "first_read", m.get("early_first_read"), "set_done", m.get("prefetch_done"), "set_s", ip.get("seconds"), "readers", ip.get("readers"), "imported", m.get("imported"), "head", (rd.get("head_start") or {}).get("verdict"), "gentle", (rk.get("loader") or {}).get("disk", {}).get("gentle_seconds"))
PY
