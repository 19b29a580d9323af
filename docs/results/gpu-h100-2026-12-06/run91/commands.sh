R=/tmp/wcres91; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$R/head LOAD_LAYOUTS=sharded,single,many LOAD_PARTS=lean,headstart BENCH_TIMEOUT=540 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "head done $(el)s"
python3 - $R/head/bench_load.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["layouts"].items():
    s = s.get("summary", s)
    print(name, "dev", s.get("device_reads_s"))
    for k in ("preload_cold_model", "preload_cold_model_nohead", "preload_cold_model_headstart_again", "preload_cold_model_nohead_again"):
        m = s.get(k + "_start_marks") or {}
        print(" ", k, s.get(k + "_ready_s"), s.get(k + "_ready_vs_device_read"), (s.get(k + "_head_start") or {}).get("verdict"), "spawned", m.get("launcher_spawned"), "asking", m.get("launcher_head_asking"), "asked", m.get("launcher_head_asked"), "first_read", m.get("early_first_read"), "imported", m.get("imported"))
PY
