#!/bin/bash
cd /work/wt/speed
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness
yes > /dev/null &
Y=$!
trap "kill $Y" EXIT
for i in 1 2 3; do
  echo "== run $i $(date -u +%T) $(uptime)"
  /work/main/.nox/shared/bin/python -m pytest -q -x -rf -m "not slow" reference_impl/tests/server/ops/test_lookup_turns.py reference_impl/tests/server/test_lent_frames.py reference_impl/tests/server/test_tenancy.py reference_impl/tests/server/l2/test_l2_server.py reference_impl/tests/server/test_prefetch.py 2>&1 | tail -40
  echo "== end $i $(date -u +%T) $(uptime)"
done
