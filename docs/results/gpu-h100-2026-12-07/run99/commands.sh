#!/usr/bin/env bash
# run99: copy mode's ways in turn, each also with the copy-mode thread's earlier work settled
# first; the attach bench twice.
set -u
DEST=$OUT
for k in 1 2; do
  export OUT=/tmp/g2-$k; mkdir -p $OUT
  ATTACH_PARTS=shard BENCH_TIMEOUT=200 bash tests/gpu/run_device.sh attach 2>&1 \
    | grep -E 'copy|TB/s|phases|attach, median|first attach' | head -40
  cp $OUT/bench_attach.json $DEST/bench_attach_$k.json
  cp $OUT/bench_attach.log $DEST/bench_attach_$k.log
done
cp /tmp/g2-1/environment.txt $DEST/
