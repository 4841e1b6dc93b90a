#!/bin/bash
# Old (main 8609724) and new (this branch) on the CPU path, alternated in one run, same load:
#   bash ab.sh OLD_TREE NEW_TREE OUT_DIR [passes]
# fixed_cost (a 2- and a 71-chunk TP8 store and load, step by step), then plan_build.py (what a load builds before its
# first copy).
set -u
old=$1 new=$2 out=$3 passes=${4:-3}
py=${PY:-/work/main/.nox/shared/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/../alternate.sh" "$old" "$new" "$out/fixed_cost.jsonl" "$passes" $py -m hybridkv_bench.microbench.fixed_cost \
  --device cpu --presets qwen3.6-27b:8 --chunks 2 71 --rounds 100 --commit fenced --json
bash "$here/../alternate.sh" "$old" "$new" "$out/plan_build.jsonl" "$passes" $py "$here/plan_build.py"
