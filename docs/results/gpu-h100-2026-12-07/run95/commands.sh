R=/tmp/wcres95; mkdir -p $R; pk() { tar czf $OUT/all.tgz -C $R . ; }
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$R/torchfree PROBE_ROUNDS=3 BENCH_TIMEOUT=300 bash tests/gpu/run_device.sh probe_torchfree >/dev/null 2>&1; pk
echo "torchfree done $(el)s"; grep -v '^\s*$' $R/torchfree/probe_torchfree.log | tail -9 | cut -c1-600
