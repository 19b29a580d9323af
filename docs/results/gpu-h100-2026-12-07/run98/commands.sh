#!/usr/bin/env bash
# run98: copy mode into fresh memory (torch's block against the engine's own allocations beside
# the copies), the copy tests, the driver probe with the destination cases, the read patterns.
set -u
DEST=$OUT; export OUT=/tmp/g1; mkdir -p $OUT
export ATTACH_PARTS=shard BENCH_TIMEOUT=200 PROBE_REPEATS=5 PROBE_PIECES=4 PROBE_ROUNDS=2
PYTEST_ARGS="tests/gpu/test_cuda.py -kcopy" TESTS_TIMEOUT=200 \
  bash tests/gpu/run_device.sh tests attach probe_copy probe_readsize 2>&1 | grep -v '^\s*$' \
  | grep -E 'passed|failed|Error|error|copy mode|TB/s|^dest|^gil|^d2d|^whole|allocations_|written|"median"|x[0-9]+MiB' | head -120
cp $OUT/bench_attach.json $OUT/probe_copy.json $OUT/probe_readsize.json $DEST/ 2>/dev/null
tar czf $DEST/logs.tgz -C $OUT .
