R=/tmp/wcres82; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/restart RESTART_PARTS=fresh BENCH_TIMEOUT=570 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "restart done $(el)s"; grep -E "summary" $R/restart/bench_restart.log | cut -c1-2500
