#!/bin/bash
# usage: run_pieces.sh TAG
cd /work/wt/speed
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness
TAG=$1
PY=/work/main/.nox/shared/bin/python
run() {
  name=$1; shift
  echo "== $name start $(date -u +%T) $(uptime)" >> /tmp/speed/$TAG.load
  /usr/bin/time -f "%e s wall" $PY -m pytest -q -m "not slow" --durations=0 --durations-min=0.5 -o junit_duration_report=call --junitxml=/tmp/speed/$TAG-$name.xml "$@" > /tmp/speed/$TAG-$name.log 2>&1
  echo "== $name end $(date -u +%T) $(uptime)" >> /tmp/speed/$TAG.load
}
run server reference_impl/tests/server
run ref reference_impl/tests --ignore=reference_impl/tests/server
run kh kernels/tests harness/tests
