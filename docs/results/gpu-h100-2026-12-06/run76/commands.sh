R=/tmp/wcres76; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/seed LOAD_LAYOUTS=many LOAD_PARTS=seed BENCH_TIMEOUT=400 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load seed done $(el)s"; grep -E "^many:" $R/seed/bench_load.log | cut -c1-1500
