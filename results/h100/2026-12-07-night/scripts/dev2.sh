#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd); D=$root/.device; T0=$(date +%s)
ls /tmp/site >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
use() { export PYTHONPATH=$D/$1/reference_impl:$D/$1/kernels:$D/$1/harness:/tmp/site; }
left() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
uptime > $OUT/context2.txt
bench='import argparse, sys
from hybridkv_bench.cli import bench as b
p = argparse.ArgumentParser(); b.add_arguments(p); sys.exit(b.run(p.parse_args(sys.argv[1:])))'
runs=$(mktemp -d)
for pass in 2 3; do for t in cand main; do
  use $t
  for s in h200_cov_qwen36_tp8:"multi_turn/*-all" h200_cov_qwen36_tp8:"doc*/*-all" h200_cov_qwen3next_tp1:"doc100k/*-all"; do
    scen=${s%%:*}; cases=${s#*:}; name=$scen-$(echo "$cases" | cut -c1-3)-$t-$pass
    (cd $D/$t && timeout 60 python3 -c "$bench" scenarios/$scen.toml --out $runs/$name --cases "$cases" > $runs/$name.log 2>&1)
    echo "$name rc=$?"; grep -E "^\[[0-9]+/[0-9]+\]" $runs/$name.log | cut -c1-250
  done
  tar czf $OUT/cover2.tgz -C $runs .; left cover-$t-$pass
done; done
use cand; runs=$(mktemp -d)
for p in host library; do
  timeout 60 python3 -m hybridkv_bench.microbench.compute_beside --device cuda --impls dma --directions load --computes attention \
    --pages 409600 --link-fractions 0.8 0.5 --launch graph --pacer $p --out $runs/pace-$p > $runs/pace-$p.log 2>&1
  echo "pace-$p rc=$?"; grep -E "pace [0-9]" $runs/pace-$p.log | cut -c1-220
done
tar czf $OUT/compute2.tgz -C $runs .; left end; uptime >> $OUT/context2.txt
