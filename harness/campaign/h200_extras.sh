#!/usr/bin/env bash
# Issue 15's measurements beside the coverage scenarios (h200_coverage.sh), in parts that each fit one device
# command with room to spare. Run from the repository root on the GPU machine, after `. harness/campaign/gpu_env.sh`:
#   bash harness/campaign/h200_extras.sh kernels OUT     # CUDA test suite + copy mechanisms vs the ceiling (~1 min)
#   bash harness/campaign/h200_extras.sh microbench OUT  # round-trip microbenchmarks beside a bare ZMQ echo (~1 min)
#   bash harness/campaign/h200_extras.sh l2 OUT          # L2 spill/reload vs the disk's O_DIRECT rates (~2 min)
# Results land in OUT/<part>/; every figure there is beside a ceiling measured in the same run.
set -euo pipefail
part=${1:?part: kernels, microbench or l2}
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
  *)
    echo "unknown part $part (kernels, microbench or l2)" >&2
    exit 2
    ;;
esac
