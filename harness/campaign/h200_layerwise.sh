#!/usr/bin/env bash
# Issue 26 on the H200: the layer-wise warm start. The CUDA tests of the layer-wise load and of load order,
# then the real model (Qwen3.5 at the Qwen3.6-27B shape, transformers + fla) warm-started both ways in one
# session: h200_hf_oracle (every page, then the forward) and h200_hf_layerwise (each layer waits for its own
# pages). Run from the repository root on the GPU machine with the wheels in .whl/ (fla among them):
#   OUT=/some/dir bash harness/campaign/h200_layerwise.sh
# The tree that ran is .tree-commit's (written beside the copy; results/host.py reads it into run.json).
set -uo pipefail
. harness/campaign/gpu_env.sh || exit 1
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness:$PYTHONPATH
{ cat .tree-commit 2>/dev/null || echo "no .tree-commit"; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
  python3 -c "import torch, triton, transformers, fla, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__, 'fla', fla.__version__)"; } > $OUT/tree.txt 2>&1
cat $OUT/tree.txt
timeout 120 python3 -m pytest -v -p no:cacheprovider reference_impl/tests/engine/test_layerwise.py \
  reference_impl/tests/engine/test_transfer_order.py kernels/tests/test_plan.py > $OUT/cuda.log 2>&1; echo "cuda tests rc=$?"
tail -8 $OUT/cuda.log
runs=$(mktemp -d)
for s in h200_hf_layerwise h200_hf_oracle; do
  timeout 230 python3 -m hybridkv.cli bench scenarios/$s.toml --out $runs/$s > $OUT/$s.log 2>&1; echo "$s rc=$?"
  grep -E "^\[1/1\]|Error|error" $OUT/$s.log | tail -5
done
tar czf $OUT/runs.tgz -C $runs .  # the run folders as one file (the device returns a bounded number of files)
