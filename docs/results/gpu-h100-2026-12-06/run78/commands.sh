R=/tmp/wcres78; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if echo "$GPU" | grep -q H200; then
  OUT=$R/attach4 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  OUT=$R/attach1 WEIGHTCACHE_VMM_PIECES=1 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "attach done $(el)s"; grep -iE "copy" $R/attach4/bench_attach.log $R/attach1/bench_attach.log | tail -12 | cut -c1-400
fi
OUT=$R/probe PROBE_ROUNDS=2 BENCH_TIMEOUT=80 bash tests/gpu/run_device.sh probe_prefetch_gil >/dev/null 2>&1; pk
echo "probe done $(el)s"; grep -vE "^\s*$" $R/probe/probe_prefetch_gil.log | tail -14 | cut -c1-300
OUT=$R/importab LOAD_LAYOUTS=sharded LOAD_PARTS=lean,importab BENCH_TIMEOUT=$(( 585-$(el) )) bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load importab done $(el)s"; grep -iE "import|device read|READY" $R/importab/bench_load.log | tail -16 | cut -c1-1200
