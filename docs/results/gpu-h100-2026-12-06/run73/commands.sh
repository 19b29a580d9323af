R=/tmp/wcres73; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if echo "$GPU" | grep -q H200; then
  OUT=$R/attach4 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  OUT=$R/attach1 WEIGHTCACHE_VMM_PIECES=1 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "attach done $(el)s"; grep -iE "copy" $R/attach4/bench_attach.log $R/attach1/bench_attach.log | tail -12 | cut -c1-400
fi
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=170 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(el)s"; tail -2 $R/tests/tests_gpu.log
if [ $(el) -lt 300 ]; then
  OUT=$R/holdab LOAD_LAYOUTS=sharded LOAD_PARTS=lean,holdab BENCH_TIMEOUT=$(( 580-$(el) )) bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
  echo "load holdab done $(el)s"; grep -iE "hold" $R/holdab/bench_load.log | tail -8 | cut -c1-1500
fi
