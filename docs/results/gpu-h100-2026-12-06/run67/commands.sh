R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s)
OUT=$R/hotstep LOAD_LAYOUTS=sharded LOAD_PARTS=lean,hotstep BENCH_TIMEOUT=200 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load done $(( $(date +%s)-T0 ))s"
grep -E "hotstep|hot_step" $R/hotstep/bench_load.log | tail -8 | cut -c1-600
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=200 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(( $(date +%s)-T0 ))s"; tail -5 $R/tests/tests_gpu.log
if echo "$GPU" | grep -q H200; then
  OUT=$R/attach4 ATTACH_PARTS=shard BENCH_TIMEOUT=60 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  OUT=$R/attach1 WEIGHTCACHE_VMM_PIECES=1 ATTACH_PARTS=shard BENCH_TIMEOUT=60 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "attach done $(( $(date +%s)-T0 ))s"
fi
