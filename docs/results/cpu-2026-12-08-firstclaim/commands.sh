#!/usr/bin/env bash
# The attach bench's fresh part (CPU, memfd), this tree against the one before, in turn.
cd /tmp
for i in 1 2 3; do
  for tree in old new; do
    PYTHONPATH=/tmp/shim-$tree WEIGHTCACHE_BENCH_ATTACH_PARTS=fresh \
      WEIGHTCACHE_BENCH_ATTACH_OUT=/tmp/ab-$tree-$i.json \
      /work/main/.venv/bin/python -m weightcache.cli bench --device cpu attach > /tmp/ab-$tree-$i.log 2>&1
    python3 -c "
import json; f=json.load(open('/tmp/ab-$tree-$i.json'))['fresh']
print('$tree', $i, 'zero_copy', f['zero_copy']['first_ms'], f['zero_copy']['first_phases_ms'].get('get_plan'), 'copy', f['copy']['first_ms'], 'load_file', f['load_file']['first_median_ms'])"
  done
done
