bash tests/gpu/run_device.sh > $OUT/environment.txt 2>&1
for ab in 4,16 4,8; do
  HOT_STEP_AB=$ab PYTHONPATH=/tmp/wc-shim timeout 45 python3 -P docs/results/cpu-2026-12-06-hotstep/probe_hotstep.py 16 8 cuda 128 2>&1 | tee -a $OUT/probe_hotstep_gpu_vm.out
done
HOT_STEP_AB=4,16 PYTHONPATH=/tmp/wc-shim timeout 30 python3 -P docs/results/cpu-2026-12-06-hotstep/probe_hotstep.py 16 8 cuda 128 2>&1 | tee -a $OUT/probe_hotstep_gpu_vm.out
