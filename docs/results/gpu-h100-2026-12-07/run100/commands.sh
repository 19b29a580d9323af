#!/usr/bin/env bash
# run100: the attach bench's `fresh` part: the 16 GB shard's first load in new processes (copy
# mode, zero copy, a bare allocation of the shard's size, in turn, 4 rounds).
set -u
DEST=$OUT; export OUT=/tmp/g3; mkdir -p $OUT
ATTACH_PARTS=fresh BENCH_TIMEOUT=200 bash tests/gpu/run_device.sh attach 2>&1 | tail -25
cp $OUT/bench_attach.json $OUT/bench_attach.log $OUT/environment.txt $DEST/
