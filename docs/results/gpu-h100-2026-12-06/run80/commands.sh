R=/tmp/wcres80; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
OUT=$R/tests WEIGHTCACHE_IMPORT_SET_PROCESS=1 PYTEST_ARGS=tests/gpu/test_cuda.py TESTS_TIMEOUT=170 bash tests/gpu/run_device.sh tests >/dev/null 2>&1; pk
echo "tests done $(el)s"; tail -2 $R/tests/tests_gpu.log
OUT=$R/importab LOAD_LAYOUTS=single LOAD_PARTS=lean,importab BENCH_TIMEOUT=$(( 585-$(el) )) bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load importab done $(el)s"; grep -E "READY|preload" $R/importab/bench_load.log | grep -oE "^[0-9:]+ +[a-z_ ,]+: \{.wall_to_ready_s.: [0-9.]+, .ready.: \{.ranks.: 1, .device.: .cuda., .sockets.: [^]]*\], .bytes.: [0-9]+, .seconds.: [0-9.]+" | sed -E 's/"sockets.*"seconds"/seconds/' ; grep -oE "^[a-z]+: \{.device_read_s.: [0-9.]+" $R/importab/bench_load.log
