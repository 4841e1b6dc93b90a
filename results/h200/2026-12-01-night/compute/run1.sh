# issue 26, device call 1: compute beside offload; before (b3012b8: auto = kernel under 409,600 B) / after (auto = DMA)
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/night; mkdir -p $R
nvidia-smi > $R/nvidia-smi.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
B=$PWD/.device/offload
(command -v git || echo "no git") > $R/git.txt
env_for() { echo "$1/reference_impl:$1/kernels:$1/harness:/tmp/site"; }
for t in before after; do
  PYTHONPATH=$(env_for $B/$t) python3 -c "
import hybridkv_kernels, hybridkv_bench.context as c
from hybridkv_kernels import choose_impl
print('$t', hybridkv_kernels.__file__, c.git_revision('$B/$t'), {p: choose_impl('auto', p, 'cuda') for p in (65536,147456,278528,409600,3211264)})" | tee -a $R/trees.txt
done
cd $B/after
PYTHONPATH=$(env_for $B/after) timeout 150 python3 -m pytest -q -p no:cacheprovider kernels/tests/test_dispatch.py kernels/tests/test_copy_cuda.py > $R/cuda-tests.log 2>&1; tail -2 $R/cuda-tests.log
for t in before after; do
  cd $B/$t
  PYTHONPATH=$(env_for $B/$t) python3 -m hybridkv_bench.compute_beside --device cuda --impls auto --out $R/auto-$t > $R/auto-$t.log 2>&1
  tail -22 $R/auto-$t.log | grep -v "^|---"
done
cd $B/after
PYTHONPATH=$(env_for $B/after) PYTHON=python3 bash harness/campaign/h200_extras.sh compute $R > $R/extras.log 2>&1
grep -h "compute " $R/compute/*.log | cut -c1-200
cd /tmp && tar czf $OUT/night1.tgz night
