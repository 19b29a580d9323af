R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
OUT=$R/fresh RESTART_PARTS=fresh BENCH_TIMEOUT=250 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
OUT=$R/seed LOAD_LAYOUTS=sharded LOAD_PARTS=lean,seed BENCH_TIMEOUT=300 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
nvidia-smi --query-gpu=name --format=csv,noheader
grep -E "summary|fresh node|first logits" $R/fresh/bench_restart.log | tail -8 | cut -c1-400
grep -E "READY|first start|seed" $R/seed/bench_load.log | tail -14 | cut -c1-300
