R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
OUT=$R/single LOAD_LAYOUTS=single LOAD_PARTS=seed BENCH_TIMEOUT=330 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
nvidia-smi --query-gpu=name --format=csv,noheader
grep -E "summary" $R/single/bench_load.log | tail -1 | cut -c1-600
