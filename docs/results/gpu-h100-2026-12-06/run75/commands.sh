R=/tmp/wcres75; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
if echo "$GPU" | grep -q H200; then
  OUT=$R/attach4 ATTACH_PARTS=shard BENCH_TIMEOUT=70 bash tests/gpu/run_device.sh attach >/dev/null 2>&1; pk
  echo "attach done $(el)s"; grep -iE "copy" $R/attach4/bench_attach.log | tail -6 | cut -c1-400
fi
OUT=$R/seed LOAD_LAYOUTS=sharded LOAD_PARTS=seed BENCH_TIMEOUT=$(( 585-$(el) )) bash tests/gpu/run_device.sh load >/dev/null 2>&1; pk
echo "load seed done $(el)s"; grep -E "^sharded:" $R/seed/bench_load.log | cut -c1-1500
