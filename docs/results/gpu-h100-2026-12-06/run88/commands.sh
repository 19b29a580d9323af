R=/tmp/wcres88; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/attach ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
echo "attach done $(el)s"; grep -E "copy mode [0-9]|copy phases|copy_reused_block phases|copy_into_out phases" $R/attach/bench_attach.log
OUT=$R/probe PROBE_REPEATS=5 PROBE_PIECES=4 BENCH_TIMEOUT=60 bash tests/gpu/run_device.sh probe_copy >/dev/null 2>&1; pk
echo "probe done $(el)s"; head -9 $R/probe/probe_copy.log | cut -c1-330
OUT=$R/seed LOAD_LAYOUTS=sharded LOAD_PARTS=seed BENCH_TIMEOUT=$(( 560-$(el) )) bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "seed done $(el)s"
python3 - $R/seed/bench_load.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["layouts"].items():
    s = s.get("summary", s)
    print(name, "dev", s.get("device_reads_s"), "lf", s.get("load_file_cold_s"), "fp", s.get("from_pretrained_cold_s"))
    for k in ("preload_cold", "preload_cold_first_start", "preload_cold_seeded_first_start", "preload_cold_model"):
        ph = s.get(k + "_phases") or {}
        print(" ", k, s.get(k + "_ready_s"), "dev", s.get(k + "_ready_vs_device_read"), "lf", s.get(k + "_ready_vs_load_file_cold"), "fp", s.get(k + "_ready_vs_from_pretrained_cold"), "startup", ph.get("startup_seconds"), "alloc", ph.get("allocate_seconds"), "fill", ph.get("fill_seconds"))
PY
