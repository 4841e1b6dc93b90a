#!/bin/sh
# The engine client before and after its one-path reshape, alternated in one run: each round runs the lookup
# round trips and the fixed-cost microbenchmark on the old tree, then on the new one.
#   sh engine_bench.sh OLD_TREE NEW_TREE ROUNDS PYTHON > engine_runs.jsonl
OLD=$1; NEW=$2; N=${3:-3}; PY=${4:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
for i in $(seq "$N"); do
  for side in old new; do
    [ $side = old ] && T=$OLD || T=$NEW
    export PYTHONPATH=$T/reference_impl:$T/kernels:$T/harness
    echo "{\"round\": $i, \"tree\": \"$side\", \"uptime\": \"$(uptime | sed 's/.*load/load/')\"}"
    "$PY" "$HERE/lookup_rt.py" 2000 | sed "s/^{/{\"round\": $i, \"tree\": \"$side\", /"
    "$PY" -m hybridkv_bench.microbench.fixed_cost --presets qwen3.6-27b:1 --chunks 2 71 --rounds 100 --json \
      | sed "s/^{/{\"round\": $i, \"tree\": \"$side\", /"
  done
done
