#!/usr/bin/env bash
# The H200 campaign (issue 5), in parts that each finish inside one 10-minute device command and carry
# their own calibration. Run from the repository root on the GPU machine:
#   bash harness/campaign/h200.sh a OUT    # zero-copy paths vs CUDA-IPC (scenario h200_zero_copy) + L2 vs disk
#   bash harness/campaign/h200.sh b OUT    # the seed's formats (scenario h200_seed_formats)
# Results land in OUT/<part>/ (run folders with run.json, requests.csv, plots, report.md; l2.json).
set -euo pipefail
part=${1:?part a or b}
out=${2:?output directory}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv > "$out/gpu-$part.csv" 2>&1 || true
case "$part" in
  a)
    python3 -m hybridkv.cli bench scenarios/h200_zero_copy.toml --out "$out/zero_copy"
    python3 -m hybridkv.cli l2bench scenarios/l2/h200_disk.toml --out "$out/l2" 2>&1 | tee "$out/l2.log"
    ;;
  b)
    python3 -m hybridkv.cli bench scenarios/h200_seed_formats.toml --out "$out/seed_formats"
    ;;
  *)
    echo "unknown part $part (a or b)" >&2
    exit 2
    ;;
esac
