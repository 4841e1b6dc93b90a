#!/bin/bash
# Old and new trees' PageCodec.read_cache on the CPU, alternated in one run.  usage: ab.sh OLD NEW OUT [passes]
set -u
old=$1 new=$2 out=$3 passes=${4:-3}
py=${PY:-/work/main/.nox/shared/bin/python}
mkdir -p "$out"
for pass in $(seq 1 "$passes"); do
  for tree in old new; do
    dir=$old; [ $tree = new ] && dir=$new
    echo "== $tree pass $pass $(uptime)" >> "$out/uptime.txt"
    PYTHONPATH=$dir/reference_impl:$dir/kernels:$dir/harness $py "$(dirname "$0")/read_cache.py" $tree >> "$out/read_cache.jsonl"
  done
done
echo "== end $(uptime)" >> "$out/uptime.txt"
