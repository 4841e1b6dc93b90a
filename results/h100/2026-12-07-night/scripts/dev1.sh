#!/usr/bin/env bash
# call 1 (issue 37): load beside prepare/store A/B (base 9d8dd9e, main, cand), CUDA tests on cand, multi-turn main vs
# cand, LMCache probe, compute beside loads/stores paced by the library, batched-memcpy flags
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd); D=$root/.device; T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
use() { export PYTHONPATH=$D/$1/reference_impl:$D/$1/kernels:$D/$1/harness:/tmp/site; }
left() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  for t in base main cand; do echo "$t $(cat $D/$t/.tree-commit)"; done; nproc; uptime; } 2>&1 | tee $OUT/context.txt
for t in base main cand main cand; do
  use $t; (cd $D/$t && timeout 60 python3 $D/beside.py $t --chunks 3 8 15 --rounds 15 >> $OUT/beside.jsonl 2>> $OUT/beside.err) || echo "beside $t rc=$?"
done
python3 - $OUT/beside.jsonl <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[(r["chunks"], r["mode"], r["tag"])].append(r)
for k, rs in sorted(rows.items()):
    print(*k, "retrieve", [r["retrieve_us"] for r in rs], "issue", [r["issue_us"] for r in rs], "st_issue", [r["store_issue_us"] for r in rs])
PY
tail -3 $OUT/beside.err; left tests
use cand; (cd $D/cand && timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine kernels/tests \
  reference_impl/tests/server/test_prepare_store.py -rs > $OUT/cuda-tests.log 2>&1); echo "cuda tests rc=$?"; tail -2 $OUT/cuda-tests.log
grep -E "^(FAILED|ERROR)" $OUT/cuda-tests.log | head
left lmc; mkdir -p /tmp/lmc && (cd /tmp/lmc && python3 -m zipfile -e $D/lmc/lmcache-*.whl . ) 2>&1 | tail -2
use cand; timeout 45 python3 $D/lmc.py /tmp/lmc > $OUT/lmcache.log 2>&1; echo "lmc rc=$?"; cut -c1-700 $OUT/lmcache.log | tail -14
runs=$(mktemp -d); left compute
timeout 100 python3 -m hybridkv_bench.microbench.compute_beside --device cuda --impls dma --directions load store --computes attention \
  --pages 409600 --link-fractions 1.0 0.8 0.6 0.4 --launch graph --pacer library --out $runs/pace-lib > $runs/pace-lib.log 2>&1
echo "pace-lib rc=$?"; grep -E "pace [0-9]" $runs/pace-lib.log | cut -c1-220
tar czf $OUT/compute.tgz -C $runs .
bench='import argparse, sys
from hybridkv_bench.cli import bench as b
p = argparse.ArgumentParser(); b.add_arguments(p); sys.exit(b.run(p.parse_args(sys.argv[1:])))'
runs=$(mktemp -d); left cover
for t in main cand; do
  use $t; name=mt-$t
  (cd $D/$t && timeout 80 python3 -c "$bench" scenarios/h200_cov_qwen36_tp8.toml --out $runs/$name --cases "multi_turn/*-all" > $runs/$name.log 2>&1)
  echo "$name rc=$?"; grep -E "^\[[0-9]+/[0-9]+\]" $runs/$name.log | cut -c1-300
  tar czf $OUT/cover.tgz -C $runs .
done
left end; uptime | tee -a $OUT/context.txt
