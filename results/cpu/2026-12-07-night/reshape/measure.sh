#!/bin/bash
# alternate old (main) and new (h-ops HEAD snapshot): lookup p50 and fixed_cost, 3 rounds each
OUT=/tmp/ops-measure; mkdir -p $OUT
S=/tmp/ops-snap2/results/cpu/2026-12-07-night/reshape/lookup_p50.py
[ -f $S ] || S=/work/wt/ops/results/cpu/2026-12-07-night/reshape/lookup_p50.py
echo "start $(date -u +%H:%M:%S) $(uptime)" >> $OUT/log
for i in 1 2 3; do
  for t in old new; do
    d=/tmp/ops-old; [ $t = new ] && d=/tmp/ops-snap2
    echo "$t $i $(PYTHONPATH=$d/reference_impl:$d/kernels:$d/harness /work/main/.nox/shared/bin/python $S --rounds 400 --json)" >> $OUT/lookup.txt
    echo "uptime $(uptime)" >> $OUT/lookup.txt
  done
done
for i in 1 2; do
  for t in old new; do
    d=/tmp/ops-old; [ $t = new ] && d=/tmp/ops-snap2
    echo "### $t $i $(uptime)" >> $OUT/fixed_cost.txt
    (cd $d && PYTHONPATH=$d/reference_impl:$d/kernels:$d/harness /work/main/.nox/shared/bin/python -m hybridkv_bench.microbench.fixed_cost >> $OUT/fixed_cost.txt 2>&1)
  done
done
echo "end $(date -u +%H:%M:%S) $(uptime)" >> $OUT/log
