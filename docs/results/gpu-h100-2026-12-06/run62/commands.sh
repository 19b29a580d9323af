R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=170 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  new() { d=$1; shift; env OUT=$R/$d "$@" ATTACH_PARTS=shard BENCH_TIMEOUT=55 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; }
  new four1 X=1; new one1 WEIGHTCACHE_VMM_PIECES=1; pk
fi
OUT=$R/many LOAD_LAYOUTS=many LOAD_PARTS=seed BENCH_TIMEOUT=330 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
nvidia-smi --query-gpu=name --format=csv,noheader
grep -E 'passed|failed' $R/tests/tests_gpu.log | tail -2
grep -h copy_tb_per_s $R/*/bench_attach.log 2>/dev/null | cut -c1-300
grep -E "summary" $R/many/bench_load.log | tail -1 | cut -c1-600
