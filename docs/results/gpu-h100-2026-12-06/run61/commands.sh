R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
OUT=$R/seedfull LOAD_LAYOUTS=sharded LOAD_PARTS=seed BENCH_TIMEOUT=420 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
nvidia-smi --query-gpu=name --format=csv,noheader
grep -E "summary" $R/seedfull/bench_load.log | tail -3 | cut -c1-1500
