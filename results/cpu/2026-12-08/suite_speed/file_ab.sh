#!/bin/bash
# One test file, the old tree and the new alternated: ./file_ab.sh FILE [ROUNDS]; OLD and NEW are the two trees
# (OLD: `git worktree add --detach /tmp/startup-old 0e65eb4`). Prints pytest's summary, the wall time and the load.
f=$1
OLD=${OLD:-/tmp/startup-old}
NEW=${NEW:-/work/wt/startup}
for i in $(seq "${2:-2}"); do
 for t in "$OLD" "$NEW"; do
  cd "$t" || exit 1
  export PYTHONPATH=$t/reference_impl:$t/kernels:$t/harness
  s=$(date +%s.%N)
  /work/main/.nox/shared/bin/python -m pytest -q -p no:cacheprovider -m "not slow" "$f" > /tmp/file_ab.log 2>&1
  rc=$?
  e=$(date +%s.%N)
  echo "$t rc=$rc $(tail -1 /tmp/file_ab.log) wall=$(echo "$e - $s" | bc) load=$(cut -d' ' -f1 /proc/loadavg)"
 done
done
