#!/usr/bin/env bash
# Call 1 for branch h-fixed (issue 37 items 2-3), about 8 device minutes: the CUDA tests of the branch, fixed_cost
# main vs h-fixed alternated (h-fixed with a short plan's first driver call of 16 runs, its default, and off), the
# batched memcpy probe.
# From the lead's checkout, after `bash harness/campaign/device_trees.sh h-fixed main` (.device/cand = h-fixed,
# .device/base = main), with `.device` and `.whl` carried:  OUT=$OUT bash results/h100/2026-12-08/scripts/fixed1.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd); D=$root/.device; T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
use() { export PYTHONPATH=$D/$1/reference_impl:$D/$1/kernels:$D/$1/harness:/tmp/site; tag=$(cut -c1-7 $D/$1/.tree-commit); }
left() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  for t in base cand; do echo "$t $(cat $D/$t/.tree-commit)"; done; nproc; uptime; } 2>&1 | tee $OUT/context.txt
left tests  # ~50 s: the branch's CUDA tests (new: first slice, attribute variants, random plans)
use cand; (cd $D/cand && timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine \
  kernels/tests reference_impl/tests/server/test_prepare_store.py harness/tests/test_memcpy_probe.py -rs \
  > $OUT/cuda-tests.log 2>&1); echo "cuda tests rc=$?"; tail -2 $OUT/cuda-tests.log; grep -E "^(FAILED|ERROR)" $OUT/cuda-tests.log | head
left fixed_cost  # ~4 min: 2 passes x (main, h-fixed, h-fixed with the first slice off), alternated
fc() {  # fc TREE LABEL [ARGS]: one fixed_cost row set, tagged
  use $1; local label=$2; shift 2
  (cd $D/$1 && timeout 70 python3 -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 8 \
    --presets qwen3.6-27b:8 --chunks 2 71 --rounds 30 --commit fenced --json "$@") \
    | sed "s/^{/{\"tree\": \"$label\", \"pass\": $pass, /" >> $OUT/fixed_cost.jsonl || echo "fixed_cost $label rc=$?"
}
for pass in 1 2; do
  fc base main; fc cand fixed; fc cand fixed-fs16 --first-slice-runs 16
done
python3 - $OUT/fixed_cost.jsonl <<'PY'
import collections, json, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line); rows[(r["chunks"], r["tree"])].append(r["p50_us"])
keys = ("store_prepared", "store_prepared.to_copy", "store_prepared.issue", "store_prepared.wait", "store_prepared.commit_rt",
        "load", "load.to_copy", "load.issue", "load.wait", "load.wake", "load_retrieve", "load_beside_prepare")
for (chunks, tree), ps in sorted(rows.items()):
    print(f"{chunks:2d} {tree:9s} n={len(ps)} " + " ".join(f"{k} {statistics.median(p[k] for p in ps):.0f}" for k in keys))
PY
left probe  # ~2.5 min: driver call time, issue-to-done per attribute variant and first slice; attention beside
use cand; (cd $D/cand && timeout 200 python3 -m hybridkv_bench.microbench.memcpy_probe --runs 80 1184 --compute --json \
  > $OUT/memcpy_probe.jsonl 2> $OUT/memcpy_probe.err); echo "memcpy_probe rc=$?"; tail -3 $OUT/memcpy_probe.err
python3 - $OUT/memcpy_probe.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
PY
left end; uptime | tee -a $OUT/context.txt
