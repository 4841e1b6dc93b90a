#!/bin/bash
# The quiet window (nothing else running on the 2-core VM): issue 38's "no behaviour change" figures, old (9d8dd9e, the
# tree issue 38 reviewed, before every move) and new (this stop's main) alternated: the lookup round trip p50 and the
# CPU fixed cost of a TP8 store and load. lookup_p50.py: ../../2026-12-07-night/reshape/lookup_p50.py
# with its imports found where each tree has them (the same code otherwise).
#   OLD=/tmp/q-old bash run.sh OUT_DIR    (OLD: `git archive 9d8dd9e`)
set -u
out=${1:?out dir}; old=${OLD:-/tmp/q-old}; new=$(git rev-parse --show-toplevel); here=$(cd "$(dirname "$0")" && pwd)
py=${PY:-$new/.nox/shared/bin/python}
mkdir -p "$out"
for i in 1 2 3 4 5; do
  echo "old $i $(uptime)" >> "$out/uptime.txt"
  echo "old $i $(PYTHONPATH=$old/reference_impl:$old/kernels:$old/harness $py $here/lookup_p50.py --rounds 1000 --json)" >> "$out/lookup.txt"
  echo "new $i $(uptime)" >> "$out/uptime.txt"
  echo "new $i $(PYTHONPATH=$new/reference_impl:$new/kernels:$new/harness $py $here/lookup_p50.py --rounds 1000 --json)" >> "$out/lookup.txt"
done
bash "$here/../alternate.sh" "$old" "$new" "$out/fixed_cost.jsonl" 3 $py -m hybridkv_bench.microbench.fixed_cost \
  --device cpu --presets qwen3.6-27b:8 --chunks 2 71 --rounds 100 --commit fenced --json
echo "end $(uptime)" >> "$out/uptime.txt"
