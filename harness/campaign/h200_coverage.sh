#!/usr/bin/env bash
# Issue 15's coverage campaign (and issue 14's multi-GPU part), in parts that each fit one device command
# of under 8 minutes and carry their own calibration (D2H, H2D, both at once, host memcpy; all GPUs at once
# where several are visible). Run from the repository root on the GPU machine:
#   bash harness/campaign/h200_coverage.sh tp1 OUT         # Qwen3.6-27B TP1: 56k and 100k documents
#   bash harness/campaign/h200_coverage.sh tp1w OUT        # Qwen3.6-27B TP1: multi-turn, divergence, fan-out
#   bash harness/campaign/h200_coverage.sh tp4 OUT         # the same on one TP4 rank's layout
#   bash harness/campaign/h200_coverage.sh tp8 OUT         # the same on one TP8 rank's layout (400-token blocks)
#   bash harness/campaign/h200_coverage.sh next OUT        # the same on Qwen3-Next-80B TP1 (544-token blocks)
#   bash harness/campaign/h200_coverage.sh concurrent OUT  # store while load (bidir); 4 TP4 / 8 TP8 engines on one GPU
#   bash harness/campaign/h200_coverage.sh x8 OUT          # 8 TP8 engines on 8 GPUs (nvidia-h200-x8 only)
#   bash harness/campaign/h200_coverage.sh prefetch OUT    # conversation prefetch: warm TTFT from L1 / L2 / L2 + hint
# Add --quick F after OUT to shrink every scenario (F in (0, 1]; the tests run the parts this way on CPU).
# Results land in OUT/<part>/<scenario>[-<cases>]/ (run.json, requests.csv, plots, report.md) beside
# OUT/gpu-<part>.csv. A run is "scenario" or "scenario:GLOB" (only the cases GLOB selects).
set -euo pipefail
part=${1:?part: tp1, tp1w, tp4, tp8, next, concurrent, x8 or prefetch}
out=${2:?output directory}
shift 2
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
case "$part" in
  tp1) runs=("h200_cov_qwen36_tp1:doc*") ;;
  tp1w) runs=("h200_cov_qwen36_tp1:multi_turn/*" "h200_cov_qwen36_tp1:divergence/*" "h200_cov_qwen36_tp1:fan_out/*") ;;
  tp4) runs=("h200_cov_qwen36_tp4") ;;
  tp8) runs=("h200_cov_qwen36_tp8") ;;
  next) runs=("h200_cov_qwen3next_tp1") ;;
  concurrent) runs=("h200_cov_store_while_load" "h200_cov_engines_one_gpu" "tp4_engines:shm-*") ;;
  x8) runs=("h200x8_tp8_engines") ;;
  prefetch) runs=("h200_prefetch") ;;
  *)
    echo "unknown part $part (tp1, tp1w, tp4, tp8, next, concurrent, x8 or prefetch)" >&2
    exit 2
    ;;
esac
mkdir -p "$out/$part"
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv > "$out/gpu-$part.csv" 2>&1 || true
status=0
for run in "${runs[@]}"; do
  scenario=${run%%:*}
  folder=$scenario
  cases=()
  if [[ "$run" == *:* ]]; then
    cases=(--cases "${run#*:}")
    folder="$scenario-$(tr -c 'a-zA-Z0-9_\n' '_' <<< "${run#*:}" | sed 's/_*$//')"
  fi
  # a failed case is recorded in its run folder; go on with the next run, fail the part at the end
  "$py" -m hybridkv.cli bench "scenarios/$scenario.toml" --out "$out/$part/$folder" "${cases[@]}" "$@" || status=1
done
exit $status
