R=/tmp/wcres72; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s)
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=150 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(( $(date +%s)-T0 ))s"; tail -2 $R/tests/tests_gpu.log
OUT=$R/holdab RESTART_PARTS=holdab BENCH_TIMEOUT=200 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "restart holdab done $(( $(date +%s)-T0 ))s"; grep -E "hold-ab summary" $R/holdab/bench_restart.log | cut -c1-3000
