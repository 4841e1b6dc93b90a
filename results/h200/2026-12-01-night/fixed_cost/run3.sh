# issue 26, device call 3: batched DMA in slices (after, 4b61575) vs two calls per plan (before, 86105ce): fixed_cost of a TP8 rank's
# 71- and 250-chunk stores / loads on real pages, twice each, interleaved; a bare round trip after idle gaps; the CUDA copy tests
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
B=$PWD/.device/offload
pp() { echo "$B/$1/reference_impl:$B/$1/kernels:$B/$1/harness:/tmp/site"; }
cd $B/after
PYTHONPATH=$(pp after) timeout 40 python3 -m pytest -q -p no:cacheprovider kernels/tests/test_copy_cuda.py > $OUT/cuda-tests-after.log 2>&1; tail -1 $OUT/cuda-tests-after.log
for i in 1 2; do [ $i = 2 ] && [ $SECONDS -gt 70 ] && break; for t in before after; do
  cd $B/$t
  PYTHONPATH=$(pp $t) timeout 40 python3 -m hybridkv_bench.fixed_cost --device cuda --page-bytes 0 --l1-gib 12 --chunks 71 250 --rounds 8 \
    --presets qwen3.6-27b:8 --json >> $OUT/fixed_cost-$t.jsonl 2>&1
  echo "$t $i $(git rev-parse --short HEAD)"
done; done
cd $B/after
PYTHONPATH=$(pp after) timeout 20 python3 -m hybridkv_bench.fixed_cost --idle-rt --rounds 30 --json > $OUT/idle_rt.json 2>&1
cat $OUT/idle_rt.json
for t in before after; do PYTHONPATH=$(pp after) python3 -c "
import json,sys
for l in open('$OUT/fixed_cost-$t.jsonl'):
    if not l.startswith('{'): print(l[:200]); continue
    r=json.loads(l); p=r['p50_us']
    print('$t', r['chunks'], {k: round(p[k]) for k in ('store_prepared','store_prepared.issue','store_prepared.wait','store_prepared.commit_rt','load','load.issue','load.wait','run_plan','commit_rt','prepare_rt')})
"; done
