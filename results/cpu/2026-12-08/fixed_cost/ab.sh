#!/bin/bash
# Old (main 8609724) and new (this branch) fixed_cost on the CPU path, alternated in one run, same load.
# usage: ab.sh OLD_TREE NEW_TREE OUT_DIR [passes]
set -u
old=$1 new=$2 out=$3 passes=${4:-3}
py=${PY:-/work/main/.nox/shared/bin/python}
mkdir -p "$out"
for pass in $(seq 1 "$passes"); do
  for tree in old new; do
    dir=$old; [ $tree = new ] && dir=$new
    echo "== $tree pass $pass $(uptime)" >> "$out/uptime.txt"
    PYTHONPATH=$dir/reference_impl:$dir/kernels:$dir/harness $py -m hybridkv_bench.microbench.fixed_cost \
      --device cpu --presets qwen3.6-27b:8 --chunks 2 71 --rounds 100 --commit fenced --json \
      | sed "s/^{/{\"tree\": \"$tree\", \"pass\": $pass, /" >> "$out/fixed_cost.jsonl"
  done
done
echo "== end $(uptime)" >> "$out/uptime.txt"
# the plan a load builds before its first copy, the same alternation
for pass in $(seq 1 "$passes"); do
  for tree in old new; do
    dir=$old; [ $tree = new ] && dir=$new
    PYTHONPATH=$dir/reference_impl:$dir/kernels:$dir/harness $py "$(dirname "$0")/plan_build.py" $tree >> "$out/plan_build.jsonl"
  done
done
echo "== end plan_build $(uptime)" >> "$out/uptime.txt"
