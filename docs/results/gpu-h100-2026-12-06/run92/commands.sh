R=/tmp/wcres92; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$R/seed LOAD_LAYOUTS=sharded LOAD_PARTS=seed BENCH_TIMEOUT=330 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "seed done $(el)s"
python3 - $R/seed/bench_load.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["layouts"].items():
    s = s.get("summary", s)
    print(name, "dev", s.get("device_reads_s"), "lf", s.get("load_file_cold_s"), "fp", s.get("from_pretrained_cold_s"), "warm fill", s.get("preload_warm_rank_gb_per_s"), s.get("preload_warm_again_rank_gb_per_s"))
    for k in ("preload_cold", "preload_cold_first_start", "preload_cold_seeded_first_start", "preload_cold_model"):
        m = s.get(k + "_start_marks") or {}
        print(" ", k, s.get(k + "_ready_s"), "dev", s.get(k + "_ready_vs_device_read"), "lf", s.get(k + "_ready_vs_load_file_cold"), "fp", s.get(k + "_ready_vs_from_pretrained_cold"), (s.get(k + "_head_start") or {}).get("verdict"), "first_read", m.get("early_first_read"), "asking", m.get("launcher_head_asking"))
PY
OUT=$R/head2 LOAD_LAYOUTS=sharded LOAD_PARTS=lean,headstart BENCH_TIMEOUT=200 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "head2 done $(el)s"
python3 - $R/head2/bench_load.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["layouts"].items():
    s = s.get("summary", s)
    print(name, "dev", s.get("device_reads_s"))
    for k in ("preload_cold_model", "preload_cold_model_nohead", "preload_cold_model_headstart_again", "preload_cold_model_nohead_again"):
        print(" ", k, s.get(k + "_ready_s"), s.get(k + "_ready_vs_device_read"), (s.get(k + "_head_start") or {}).get("verdict"), "startup", (s.get(k + "_phases") or {}).get("startup_seconds"), "short", s.get(k + "_disk_short_s"))
PY
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=200 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(el)s"; tail -3 $R/tests/*.log 2>/dev/null | cut -c1-300
