bash tests/gpu/run_device.sh > $OUT/environment.txt 2>&1
for i in 1 2; do for dev in cuda cpu; do
  PYTHONPATH=/tmp/wc-shim timeout 100 python3 -P docs/results/cpu-2026-12-06-hotstep/probe_hotstep.py 16 8 $dev 128 2>&1 | tee -a $OUT/probe_hotstep_gpu_vm.out
done; done
nproc; lscpu | grep -iE "model name|L2|L3"
