#!/usr/bin/env bash
# Call 2 for branch h-fixed (issue 37 items 4 and 2), about 9 device minutes: the layer-wise warm start on the 80 GB
# card (h100_hf_layerwise, 48 layers) main vs h-fixed, then the TP8 multi-turn coverage main vs h-fixed.
# Same layout as fixed1.sh (.device/base = main, .device/cand = h-fixed, `.device` and `.whl` carried; fla among the
# wheels):  OUT=$OUT bash results/h100/2026-12-08/scripts/fixed2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd); D=$root/.device; T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
use() { export PYTHONPATH=$D/$1/reference_impl:$D/$1/kernels:$D/$1/harness:/tmp/site; }
left() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
bench='import argparse, sys
from hybridkv_bench.cli import bench as b
p = argparse.ArgumentParser(); b.add_arguments(p); sys.exit(b.run(p.parse_args(sys.argv[1:])))'
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  for t in base cand; do echo "$t $(cat $D/$t/.tree-commit)"; done; uptime; } 2>&1 | tee $OUT/context2.txt
runs=$(mktemp -d)
for t in cand base; do  # the candidate first: a call cut short keeps its figures; ~3 min each
  left hf-$t; use $t; name=hf-$t
  (cd $D/$t && timeout 240 python3 -c "$bench" scenarios/h100_hf_layerwise.toml --out $runs/$name > $runs/$name.log 2>&1)
  echo "$name rc=$?"; grep -E "^\[1/1\]|Error|warm_pipeline|adapter" $runs/$name.log | cut -c1-300 | tail -5
  tar czf $OUT/hf.tgz -C $runs .
done
python3 - $runs <<'PY'
import json, pathlib, statistics, sys
for run in sorted(pathlib.Path(sys.argv[1]).glob("hf-*/**/run.json")):
    rec = json.loads(run.read_text())
    for case in rec.get("cases", []):
        m = case.get("metrics", {})
        vals = {k: m[k] for k in ("warm_pipeline_ratio", "adapter_s", "forward_alone_s", "warm_span_s") if k in m}
        print(run.parent.name, rec.get("git_sha", "?")[:7], vals)
PY
for t in cand base; do  # ~80 s each: 2-chunk stores, 3-17 chunk loads
  left mt-$t; use $t; name=mt-$t
  (cd $D/$t && timeout 90 python3 -c "$bench" scenarios/h200_cov_qwen36_tp8.toml --out $runs/$name --cases "multi_turn/*-all" > $runs/$name.log 2>&1)
  echo "$name rc=$?"; grep -E "^\[[0-9]+/[0-9]+\]" $runs/$name.log | cut -c1-300
  tar czf $OUT/runs.tgz -C $runs .
done
left end; uptime | tee -a $OUT/context2.txt
