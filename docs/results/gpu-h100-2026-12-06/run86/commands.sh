R=/tmp/wcres86; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/seed LOAD_LAYOUTS=sharded,single LOAD_PARTS=seed BENCH_TIMEOUT=570 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "seed done $(el)s"; grep -iE "ready|ratio|x " $R/seed/bench_load.log | head -60
