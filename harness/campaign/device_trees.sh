#!/usr/bin/env bash
# Lay out the trees a device call compares, as plain copies under .device/ (ignored by git; name `.device` and
# `.whl` in the call's `carry`): .device/cand (the tree under test) and .device/base (the baseline), each the
# `git archive` of one commit with its .tree-commit, which the runs record as the tree that ran. results/ is left
# out (it is large and no run reads it). Then, on the device, from the repository root:
#   cd .device/cand && OUT=$OUT BASE=../base bash harness/campaign/h200_issue.sh tests|profile|cover|compute|hf
# with the wheels installed first (see gpu_env.sh; the script's `use` puts /tmp/site on PYTHONPATH).
#   bash harness/campaign/device_trees.sh CANDIDATE_REV [BASE_REV]
set -euo pipefail
cand=${1:?candidate commit}; base=${2:-}
cd "$(git rev-parse --show-toplevel)"
lay() {  # lay REV DIR
  rm -rf "$2" && mkdir -p "$2"
  git archive "$1" | tar -x -C "$2"
  rm -rf "$2/results"
  git rev-parse "$1^{commit}" > "$2/.tree-commit"
  echo "$2: $(cat "$2/.tree-commit")"
}
lay "$cand" .device/cand
[ -n "$base" ] && lay "$base" .device/base
du -sh .device
