#!/usr/bin/env bash
# run100: the attach bench with a new process's first load (copy mode, zero copy, a bare
# allocation of the shard's size, in turn) after copy mode's ways in turn.
set -u
DEST=$OUT; export OUT=/tmp/g3; mkdir -p $OUT
ATTACH_PARTS=shard BENCH_TIMEOUT=300 bash tests/gpu/run_device.sh attach 2>&1 \
  | grep -E 'copy|TB/s|phases|attach, median|first attach|new process|Error|error' | head -40
cp $OUT/bench_attach.json $OUT/bench_attach.log $OUT/environment.txt $DEST/
