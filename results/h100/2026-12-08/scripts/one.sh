#!/usr/bin/env bash
# One call (2026-12-08) for issue 37 when device time is short: h-fixed (cand) against main (base), the parts in order
# of what decides the merge, each started only if the time it needs is left (limit 585 s).
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd); D=$root/.device; T0=$(date +%s); LIMIT=${LIMIT:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
use() { export PYTHONPATH=$D/$1/reference_impl:$D/$1/kernels:$D/$1/harness:/tmp/site; }
el() { echo $(( $(date +%s) - T0 )); }
fits() { [ $(( LIMIT - $(el) )) -ge $1 ]; }
bench='import argparse, sys
from hybridkv_bench.cli import bench as b
p = argparse.ArgumentParser(); b.add_arguments(p); sys.exit(b.run(p.parse_args(sys.argv[1:])))'
{ date -u; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  for t in base cand; do echo "$t $(cat $D/$t/.tree-commit)"; done; nproc; uptime; } 2>&1 | tee $OUT/context.txt
echo "== tests at $(el)"
use cand; (cd $D/cand && timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine \
  kernels/tests reference_impl/tests/server/test_prepare_store.py harness/tests/test_memcpy_probe.py -rs \
  > $OUT/cuda-tests.log 2>&1); echo "cuda tests rc=$?"; tail -2 $OUT/cuda-tests.log; grep -E "^(FAILED|ERROR)" $OUT/cuda-tests.log | head
fc() {  # fc TREE LABEL [ARGS]
  use $1; local label=$2; shift 2
  (cd $D/$1 && timeout 60 python3 -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 8 \
    --presets qwen3.6-27b:8 --chunks 2 71 --rounds 30 --commit fenced --json "$@") \
    | sed "s/^{/{\"tree\": \"$label\", \"pass\": $pass, /" >> $OUT/fixed_cost.jsonl || echo "fixed_cost $label rc=$?"
}
summ() { python3 - $OUT/fixed_cost.jsonl <<'PY'
import collections, json, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line); rows[(r["chunks"], r["tree"])].append(r["p50_us"])
keys = ("store_prepared", "store_prepared.issue", "store_prepared.wait", "load", "load.to_copy", "load.issue", "load.wait")
for (chunks, tree), ps in sorted(rows.items()):
    print(f"{chunks:2d} {tree:9s} n={len(ps)} " + " ".join(f"{k} {statistics.median(p.get(k, float('nan')) for p in ps):.0f}" for k in keys))
PY
}
echo "== fixed_cost at $(el)"; pass=1; fc base main; fc cand fixed; fc cand fixed-fs16 --first-slice-runs 16; summ
runs=$(mktemp -d)
if fits 200; then echo "== hf cand at $(el)"; use cand
  (cd $D/cand && timeout $(( LIMIT - $(el) - 150 )) python3 -c "$bench" scenarios/h100_hf_layerwise.toml --out $runs/hf-cand > $runs/hf-cand.log 2>&1)
  echo "hf rc=$?"; grep -E "^\[1/1\]|Error|warm_pipeline" $runs/hf-cand.log | cut -c1-400 | tail -4
  tar czf $OUT/hf.tgz -C $runs .; fi
for t in cand base; do if fits 75; then echo "== mt $t at $(el)"; use $t
  (cd $D/$t && timeout 70 python3 -c "$bench" scenarios/h200_cov_qwen36_tp8.toml --out $runs/mt-$t --cases "multi_turn/*-all" > $runs/mt-$t.log 2>&1)
  echo "mt-$t rc=$?"; grep -E "^\[[0-9]+/[0-9]+\]" $runs/mt-$t.log | cut -c1-300; tar czf $OUT/runs.tgz -C $runs --exclude 'hf-*' .; fi; done
if fits 70; then echo "== probe at $(el)"; use cand
  (cd $D/cand && timeout $(( LIMIT - $(el) - 5 )) python3 -m hybridkv_bench.microbench.memcpy_probe --runs 80 1184 --compute --json \
    > $OUT/memcpy_probe.jsonl 2> $OUT/memcpy_probe.err); echo "probe rc=$?"; tail -2 $OUT/memcpy_probe.err; cut -c1-300 $OUT/memcpy_probe.jsonl; fi
echo "== end at $(el)"; uptime | tee -a $OUT/context.txt
