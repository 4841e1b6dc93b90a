#!/bin/bash
F="reference_impl/tests/server/ops/test_lookup_turns.py reference_impl/tests/server/front/test_lifecycle.py"
for round in 3 4; do
for tree in /tmp/speed-old /work/wt/speed; do
  cd $tree
  export PYTHONPATH=$tree/reference_impl:$tree/kernels:$tree/harness
  echo "== $tree round $round $(uptime)"
  /work/main/.nox/shared/bin/python -m pytest -q -m "not slow" -p no:randomly --junitxml=/tmp/speed/ab-$(basename $tree)-$round.xml -o junit_duration_report=total $F 2>&1 | tail -1
done
done
echo "== end $(uptime)"
