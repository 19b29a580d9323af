R=/tmp/wcres; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s)
OUT=$R/holdab RESTART_PARTS=holdab BENCH_TIMEOUT=300 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "restart holdab done $(( $(date +%s)-T0 ))s"; grep -E "hold-ab summary" $R/holdab/bench_restart.log | cut -c1-2500
OUT=$R/loadhold LOAD_LAYOUTS=sharded LOAD_PARTS=lean,holdab BENCH_TIMEOUT=280 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load holdab done $(( $(date +%s)-T0 ))s"
python3 - <<'PY'
import json
d=json.load(open('/tmp/wcres/loadhold/bench_load.json'))['layouts']['sharded']['summary']
print('device', d.get('device_read_s'), d.get('device_reads_s'))
for k in ('preload_cold_model','preload_cold_holdfixed','preload_cold_holdgrow','preload_cold_holdfixed_again','preload_cold_holdgrow_again'):
    dk=d.get(k+'_disk') or {}
    print(k, d.get(k+'_ready_s'), d.get(k+'_ready_vs_device_read'), 'gentle', dk.get('gentle_seconds'), 'hold', dk.get('longest_hold'), 'faults', dk.get('faults'), dk.get('own_faults'))
PY
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  OUT=$R/attach4 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  OUT=$R/attach1 WEIGHTCACHE_VMM_PIECES=1 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "attach done $(( $(date +%s)-T0 ))s"; grep -iE "copy" $R/attach4/bench_attach.log $R/attach1/bench_attach.log | cut -c1-300 | tail -12
fi
