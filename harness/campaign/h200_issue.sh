#!/usr/bin/env bash
# Issue 26 on the H200 (2026-12-07): what queueing a store's copies costs, before and after cutting it, in one run.
# Run from the root of the tree under test (a copy of a commit with its .tree-commit); BASE names the root of a
# baseline tree's copy (optional) that runs the same measurements alternated with this one, on the same machine:
#   OUT=dir BASE=../t-6be3029 bash harness/campaign/h200_issue.sh profile   # issue_parts, fixed_cost, bare round trip
#   OUT=dir BASE=../t-6be3029 bash harness/campaign/h200_issue.sh cover     # CUDA tests; TP8 docs + multi-turn, Next 99k
#   OUT=dir bash harness/campaign/h200_issue.sh compute                     # compute beside loads (decode attention)
#   OUT=dir bash harness/campaign/h200_issue.sh tests                       # the CUDA tests alone (a short call)
#   OUT=dir bash harness/campaign/h200_issue.sh hf                          # the real model's layer-wise warm start
# harness/campaign/device_trees.sh lays out a candidate and a baseline tree under .device/ for such a call.
# The wheels (msgspec, pyzmq, isal) must be installed in /tmp/site already (see gpu_env.sh); no editable install:
# each tree runs from its own PYTHONPATH, so two trees can alternate.
set -uo pipefail
part=${1:?part: profile, cover, compute, tests or hf}
export PYTHONUNBUFFERED=1
trees=("$PWD")
[ -n "${BASE:-}" ] && trees=("$(cd "$BASE" && pwd)" "$PWD")
use() {  # the tree $1 on PYTHONPATH; its name (the commit) in $tag
  export PYTHONPATH=$1/reference_impl:$1/kernels:$1/harness:/tmp/site
  tag=$(cut -c1-7 "$1/.tree-commit")
}
# hybridkv bench without the entry points of an install: python3 -c "$bench" ARGS
bench='import argparse, sys
from hybridkv_bench.cli import bench as b
p = argparse.ArgumentParser(); b.add_arguments(p); sys.exit(b.run(p.parse_args(sys.argv[1:])))'
{ for t in "${trees[@]}"; do echo "$t: $(cat "$t/.tree-commit")"; done
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} > "$OUT/tree-$part.txt" 2>&1
cat "$OUT/tree-$part.txt"
case "$part" in
  profile)
    use "$PWD"
    timeout 60 python3 -m hybridkv_bench.microbench.fixed_cost --idle-rt --rounds 30 --json > "$OUT/idle_rt.json" 2>&1
    cat "$OUT/idle_rt.json"
    for pass in 1 2; do for t in "${trees[@]}"; do
      use "$t"
      echo "== $tag pass $pass" >> "$OUT/issue_parts.txt"
      # issue_parts is the tree under test's harness (the baseline's has none), over each tree's library
      PYTHONPATH=$t/reference_impl:$t/kernels:$PWD/harness:/tmp/site timeout 45 python3 -m \
        hybridkv_bench.microbench.issue_parts --device cuda --chunks 2 71 --rounds 150 \
        >> "$OUT/issue_parts.txt" 2>&1 || echo "issue_parts $tag rc=$?"
      # both commit modes, alternated within the pass (the profile moves 10-20% between runs)
      timeout 80 python3 -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 8 \
        --presets qwen3.6-27b:8 --chunks 2 71 --rounds 30 --commit fenced after_copies --json \
        | sed "s/^{/{\"tree\": \"$tag\", \"pass\": $pass, /" >> "$OUT/fixed_cost.jsonl" || echo "fixed_cost $tag rc=$?"
    done; done
    grep -E "^==|p50" "$OUT/issue_parts.txt" | cut -c1-600
    python3 - "$OUT/fixed_cost.jsonl" <<'EOF'
import collections, json, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        rows[(r["preset"], r["tp"], r["chunks"], r["commit"], r["tree"])].append(r["p50_us"])
keys = ("store_prepared", "store_prepared.to_copy", "store_prepared.issue", "store_prepared.wait",
        "store_prepared.commit_rt", "store_prepared.wake", "store", "load", "load.issue")
for (preset, tp, chunks, commit, tree), ps in sorted(rows.items()):
    med = {k: statistics.median(p[k] for p in ps) for k in keys}
    print(f"{preset} TP{tp} {chunks:2d} {commit:12s} {tree} n={len(ps)} " + " ".join(f"{k} {v:.0f}" for k, v in med.items()))
EOF
    ;;
  cover)
    use "$PWD"
    if [ "${CUDA_TESTS:-1}" = 1 ]; then  # CUDA_TESTS=0: they ran in an earlier call on this tree
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine kernels/tests \
        reference_impl/tests/server/test_prepare_store.py > "$OUT/cuda-tests.log" 2>&1
      echo "cuda tests ($tag) rc=$?"; tail -3 "$OUT/cuda-tests.log"
    fi
    runs=$(mktemp -d)
    cover() {  # the coverage workloads on tree $1, each run folder appended to cover.tar as it ends
      use "$1"
      for s in h200_cov_qwen36_tp8:"multi_turn/*-all" h200_cov_qwen36_tp8:"doc*/*-all" h200_cov_qwen3next_tp1:"doc100k/*-all"; do
        scen=${s%%:*}; cases=${s#*:}; name=$scen-$(echo "$cases" | cut -c1-3)-$tag
        (cd "$1" && timeout 90 python3 -c "$bench" "scenarios/$scen.toml" --out "$runs/$name" --cases "$cases" > "$runs/$name.log" 2>&1)
        echo "$name rc=$?"; grep -E "^\[[0-9]+/[0-9]+\]" "$runs/$name.log" | cut -c1-230
        tar rf "$OUT/cover.tar" -C "$runs" "$name" "$name.log"
      done
    }
    cover "$PWD"  # the tree under test first: a run cut short by the device's limit keeps its figures
    for t in "${trees[@]}"; do  # a TP8 rank's short stores, once more beside the coverage
      use "$t"
      timeout 60 python3 -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 8 \
        --presets qwen3.6-27b:8 --chunks 2 --rounds 30 --commit fenced after_copies --json \
        | sed "s/^{/{\"tree\": \"$tag\", \"pass\": 3, /" >> "$OUT/fixed_cost.jsonl" || echo "fixed_cost $tag rc=$?"
    done
    [ -n "${BASE:-}" ] && cover "${trees[0]}"
    ;;
  tests)
    use "$PWD"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine kernels/tests \
      reference_impl/tests/server/test_prepare_store.py -rs > "$OUT/cuda-tests.log" 2>&1
    echo "cuda tests ($tag) rc=$?"; tail -3 "$OUT/cuda-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/cuda-tests.log" | head
    ;;
  hf)
    use "$PWD"  # needs fla (flash-linear-attention, fla-core) among the wheels
    runs=$(mktemp -d)
    (cd "$PWD" && timeout 300 python3 -c "$bench" scenarios/h200_hf_layerwise.toml --out "$runs/h200_hf_layerwise" \
      > "$runs/h200_hf_layerwise.log" 2>&1)
    echo "h200_hf_layerwise rc=$?"; grep -E "^\[1/1\]|Error|warm_pipeline" "$runs/h200_hf_layerwise.log" | tail -5
    tar czf "$OUT/hf.tgz" -C "$runs" .
    ;;
  compute)
    use "$PWD"
    # decode attention beside DMA loads (0.92 in December's runs against 0.97): eager launches, the engine's stream
    # at high priority, and the compute as graph replays (no launch gaps from a busy Python process: if the ratio
    # holds there, the loss is on the host, else in the GPU's memory system)
    runs=$(mktemp -d)
    for v in "--priorities default high" "--launch graph"; do
      name=compute-$(echo $v | cut -c3-7)
      timeout 130 python3 -m hybridkv_bench.microbench.compute_beside --device cuda --impls dma --directions load \
        --computes attention matmul --pages 409600 3211264 $v --out "$runs/$name" > "$runs/$name.log" 2>&1
      echo "$name rc=$?"; tail -12 "$runs/$name.log"
    done
    tar czf "$OUT/compute.tgz" -C "$runs" .
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
