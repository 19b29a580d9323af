R=/tmp/wcres71; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s)
bash tests/gpu/run_device.sh > $R/environment.txt 2>&1
ln -sfn ../agent weightcache/agent; ln -sfn ../operator weightcache/operator
HERE=$PWD; (cd /tmp && PYTHONPATH=/tmp/wc-shim timeout 100 python3 -P $HERE/docs/results/gpu-h100-2026-12-06/run71/probe_spawns.py 4 > $R/probe_spawns.out 2>&1)
rm -f weightcache/agent weightcache/operator; pk
echo "probe done $(( $(date +%s)-T0 ))s"; grep -E "round|ld-linux|audit" $R/probe_spawns.out | cut -c1-600 | head -30
OUT=$R/holdab RESTART_PARTS=holdab BENCH_TIMEOUT=300 bash tests/gpu/run_device.sh restart 8b >/dev/null 2>&1; pk
echo "restart holdab done $(( $(date +%s)-T0 ))s"; grep -E "hold-ab summary" $R/holdab/bench_restart.log | cut -c1-3000
OUT=$R/loadhold LOAD_LAYOUTS=sharded LOAD_PARTS=lean,holdab BENCH_TIMEOUT=250 bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load holdab done $(( $(date +%s)-T0 ))s"
python3 - <<'PY'
import json
d=json.load(open('/tmp/wcres71/loadhold/bench_load.json'))['layouts']['sharded']['summary']
print('device', d.get('device_read_s'), d.get('device_reads_s'))
for k in ('preload_cold_model','preload_cold_holdbefore','preload_cold_holdnow','preload_cold_holdbefore_again','preload_cold_holdnow_again'):
    dk=d.get(k+'_disk') or {}
    print(k, d.get(k+'_ready_s'), d.get(k+'_ready_vs_device_read'), 'gentle', dk.get('gentle_seconds'), 'hold', dk.get('longest_hold'), 'faults', dk.get('faults'), dk.get('own_faults'), 'reads', dk.get('read_events'), dk.get('others_read_bytes'))
PY
