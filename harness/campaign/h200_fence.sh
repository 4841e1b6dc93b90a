#!/usr/bin/env bash
# Issue 26 on the H200: the commit sent with the copies (fenced). Parts, each one device command:
#   OUT=/some/dir bash harness/campaign/h200_fence.sh profile   # CUDA tests of stores and loads, then the fixed-cost
#                                                               # profile of fenced vs after-copies commits, same run
#   OUT=/some/dir bash harness/campaign/h200_fence.sh tp8       # h200_cov_qwen36_tp8 (documents, multi-turn, ...)
#   OUT=/some/dir bash harness/campaign/h200_fence.sh next      # h200_cov_qwen3next_tp1 (the 99k documents)
# Run from the repository root on the GPU machine with the wheels in .whl/; the tree that ran is .tree-commit's.
set -uo pipefail
part=${1:?part: profile, tp8 or next}
. harness/campaign/gpu_env.sh || exit 1
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness:$PYTHONPATH
{ cat .tree-commit 2>/dev/null || echo "no .tree-commit"; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > $OUT/tree-$part.txt 2>&1
cat $OUT/tree-$part.txt
case "$part" in
  profile)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda reference_impl/tests/engine kernels/tests \
      > $OUT/cuda.log 2>&1; echo "cuda tests rc=$?"
    tail -4 $OUT/cuda.log
    timeout 60 python3 -m hybridkv_bench.microbench.fixed_cost --idle-rt --rounds 30 --json > $OUT/idle_rt.json 2>&1
    cat $OUT/idle_rt.json
    # each preset twice, the two modes interleaved within each pass (the profile moves 10-20% between runs)
    for pass in 1 2; do
      timeout 150 python3 -m hybridkv_bench.microbench.fixed_cost --device cuda --page-bytes 0 --l1-gib 12 \
        --chunks 2 71 --rounds 40 --commit fenced after_copies after_copies fenced --json >> $OUT/fixed_cost.jsonl 2>&1
      echo "pass $pass rc=$?"
    done
    python3 - "$OUT/fixed_cost.jsonl" <<'EOF'
import collections, json, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        print(line[:200].rstrip()); continue
    r = json.loads(line)
    rows[(r["preset"], r["tp"], r["chunks"], r["commit"])].append(r["p50_us"])
for (preset, tp, chunks, commit), ps in sorted(rows.items()):
    med = {k: statistics.median(p[k] for p in ps) for k in ("store_prepared", "store_prepared.issue", "store_prepared.wait",
                                                             "store_prepared.commit_rt", "store_prepared.wake", "store", "commit_rt")}
    print(f"{preset} TP{tp} {chunks:3d} chunks {commit:12s} n={len(ps)} " + " ".join(f"{k} {v:.0f}" for k, v in med.items()))
EOF
    ;;
  tp8|next)
    # the scenario as committed (after_copies) and a copy of it with commit = "fenced", store policy `all`
    # (CASES overrides), one after the other on the same machine
    scenario=$([ "$part" = tp8 ] && echo h200_cov_qwen36_tp8 || echo h200_cov_qwen3next_tp1)
    runs=$(mktemp -d)
    sed -e "s/^name = \"$scenario\"/name = \"$scenario-fenced\"\ncommit = \"fenced\"/" scenarios/$scenario.toml \
      > $runs/$scenario-fenced.toml
    for s in scenarios/$scenario.toml $runs/$scenario-fenced.toml; do
      name=$(basename $s .toml)
      timeout 270 python3 -m hybridkv.cli bench $s --out $runs/$name --cases "${CASES:-*-all}" > $OUT/$name.log 2>&1
      echo "$name rc=$?"
      grep -E "^\[[0-9]+/[0-9]+\]|Error" $OUT/$name.log | cut -c1-260 | tail -12
    done
    tar czf $OUT/$scenario.tgz -C $runs .
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
