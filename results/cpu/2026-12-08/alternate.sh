#!/bin/bash
# Run a command with each of two trees on PYTHONPATH in turn, old then new, PASSES times, so both run under the same
# load; every JSON line it prints is appended to OUT_JSONL tagged with the tree ("old" / "new") and the pass, and
# `uptime` before each run goes to OUT_JSONL's folder (uptime.txt).
#   bash alternate.sh OLD_TREE NEW_TREE OUT_JSONL PASSES CMD [ARGS...]
set -u
old=$1 new=$2 out=$3 passes=$4
shift 4
mkdir -p "$(dirname "$out")"
for pass in $(seq 1 "$passes"); do
  for tree in old new; do
    dir=$old; [ $tree = new ] && dir=$new
    echo "== $(basename "$out") $tree pass $pass $(uptime)" >> "$(dirname "$out")/uptime.txt"
    PYTHONPATH=$dir/reference_impl:$dir/kernels:$dir/harness "$@" | grep '^{' \
      | sed "s/^{/{\"tree\": \"$tree\", \"pass\": $pass, /" >> "$out"
  done
done
echo "== $(basename "$out") end $(uptime)" >> "$(dirname "$out")/uptime.txt"
