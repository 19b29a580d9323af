R=/tmp/wcres85; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$R/tests PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=200 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(el)s"; tail -3 $R/tests/tests_gpu.log
ab() { d=$1; shift; env OUT=$R/$d "$@" ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "$d done $(el)s"; grep -E "copy mode [0-9]|copy phases" $R/$d/bench_attach.log; }
ab ahead1 WEIGHTCACHE_COPY_MAP_AHEAD=1
ab wait1 WEIGHTCACHE_COPY_MAP_AHEAD=0
ab ahead2 WEIGHTCACHE_COPY_MAP_AHEAD=1
ab wait2 WEIGHTCACHE_COPY_MAP_AHEAD=0
[ $(el) -lt 420 ] && ab ahead8 WEIGHTCACHE_COPY_MAP_AHEAD=1 WEIGHTCACHE_VMM_PIECES=8
[ $(el) -lt 470 ] && { OUT=$R/probe PROBE_REPEATS=5 PROBE_PIECES=4,8 BENCH_TIMEOUT=90 bash tests/gpu/run_device.sh probe_copy >/dev/null 2>&1; pk; echo "probe done $(el)s"; head -12 $R/probe/probe_copy.log | cut -c1-400; }
