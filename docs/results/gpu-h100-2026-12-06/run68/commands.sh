R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s)
OUT=$R/restart RESTART_PARTS=fresh BENCH_TIMEOUT=280 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "restart done $(( $(date +%s)-T0 ))s"; grep -iE "summary|first_logits|ratio" $R/restart/*.log | tail -6 | cut -c1-900
OUT=$R/importorder PROBE_ROUNDS=3 BENCH_TIMEOUT=120 bash tests/gpu/run_device.sh probe_import_order >/dev/null 2>&1; pk
echo "probe done $(( $(date +%s)-T0 ))s"; ls $R/importorder; tail -15 $R/importorder/*.log 2>/dev/null | cut -c1-400
