#!/usr/bin/env bash
# Issue 15's measurements beside the coverage scenarios (h200_coverage.sh), in parts that each fit one device
# command with room to spare. Run from the repository root on the GPU machine, after `. harness/campaign/gpu_env.sh`:
#   bash harness/campaign/h200_extras.sh kernels OUT     # CUDA test suite + copy mechanisms vs the ceiling (~1 min)
#   bash harness/campaign/h200_extras.sh microbench OUT  # round-trip microbenchmarks beside a bare ZMQ echo (~1 min)
#   bash harness/campaign/h200_extras.sh l2 OUT          # L2 spill/reload vs the disk's O_DIRECT rates (~2 min)
#   bash harness/campaign/h200_extras.sh transfer OUT    # transfer tests on CUDA + fixed cost of a store / load (~3 min)
#   bash harness/campaign/h200_extras.sh compute OUT     # compute beside stores and loads, per copy engine (~4 min)
# Results land in OUT/<part>/; every figure there is beside a ceiling measured in the same run.
set -euo pipefail
part=${1:?part: kernels, microbench, l2, transfer or compute}
out=${2:?output directory}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out/$part"
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv > "$out/$part/gpu.csv" 2>&1 || true
case "$part" in
  kernels)
    status=0
    "$py" -m pytest -q -m cuda -p no:cacheprovider > "$out/$part/cuda-tests.log" 2>&1 || status=1
    tail -3 "$out/$part/cuda-tests.log"
    "$py" kernels/bench/bench_copy_variants.py --bidir --out "$out/$part/copy_variants.json" \
      > "$out/$part/copy_variants.log" 2>&1 || status=1
    exit $status
    ;;
  microbench)
    "$py" -m pytest -q -m benchmark harness/tests/test_microbench.py --benchmark-enable --benchmark-only \
      -p no:cacheprovider --benchmark-json "$out/$part/microbench.json" 2>&1 | tail -40 | tee "$out/$part/microbench.log"
    ;;
  l2)
    "$py" -m hybridkv.cli l2bench scenarios/l2/h200_disk.toml --out "$out/$part/h200_disk"
    ;;
  transfer)
    # the transfer library's round-trip tests run on the GPU when one is visible (not only the -m cuda ones)
    status=0
    "$py" -m pytest -q -p no:cacheprovider reference_impl/tests/engine/test_transfer.py reference_impl/tests/server/test_prepare_store.py \
      > "$out/$part/transfer-tests.log" 2>&1 || status=1
    tail -3 "$out/$part/transfer-tests.log"
    # every step of a store and a load on the presets' real pages, then where the queueing of copies goes
    "$py" -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 24 --chunks 2 71 --rounds 30 --json \
      > "$out/$part/fixed_cost.jsonl" 2>&1 || status=1
    "$py" -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 24 --chunks 2 --rounds 30 --cprofile 25 \
      > "$out/$part/issue_cprofile.txt" 2>&1 || status=1
    exit $status
    ;;
  compute)
    # issue 26: matmuls and decode attention on the engine's stream while pages are stored / loaded, every copy
    # engine and preset page size; then the engine's stream at high priority, and the compute as graph replays
    # (no launch gaps from a busy Python process), on the pages where the choice matters
    "$py" -m hybridkv_bench.microbench.compute_beside --device cuda --out "$out/$part/eager" | tee "$out/$part/eager.log"
    "$py" -m hybridkv_bench.microbench.compute_beside --device cuda --priorities high --pages 147456 409600 3211264 \
      --out "$out/$part/high" | tee "$out/$part/high.log"
    "$py" -m hybridkv_bench.microbench.compute_beside --device cuda --launch graph --computes matmul \
      --pages 147456 409600 3211264 --out "$out/$part/graph" | tee "$out/$part/graph.log"
    ;;
  *)
    echo "unknown part $part (kernels, microbench, l2, transfer or compute)" >&2
    exit 2
    ;;
esac
