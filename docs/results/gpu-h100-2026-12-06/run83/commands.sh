R=/tmp/wcres83; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/apart WEIGHTCACHE_IMPORT_SET_PROCESS=1 RESTART_PARTS=fresh BENCH_TIMEOUT=280 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "apart done $(el)s"; grep -E "summary" $R/apart/bench_restart.log | cut -c1-2500
OUT=$R/beside RESTART_PARTS=fresh BENCH_TIMEOUT=$(( 585-$(el) )) bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "beside done $(el)s"; grep -E "summary" $R/beside/bench_restart.log | cut -c1-2500
