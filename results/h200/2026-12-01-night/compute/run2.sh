# issue 26, device call 2 (tree 8d63d95): auto after (DMA) on the small pages; at 147,456 B dma vs triton, engine stream default vs high priority
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
T=$PWD/.device/offload/after
cd $T
export PYTHONPATH=$T/reference_impl:$T/kernels:$T/harness:/tmp/site
python3 -c "
import hybridkv_kernels, hybridkv_bench.context as c
from hybridkv_kernels import choose_impl
print(hybridkv_kernels.__file__, c.git_revision('.'), {p: choose_impl('auto', p, 'cuda') for p in (65536,147456,278528,409600,3211264)})" > $OUT/trees.txt 2>&1
(command -v git || echo "no git") >> $OUT/trees.txt
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv >> $OUT/trees.txt
python3 -m hybridkv_bench.compute_beside --device cuda --impls auto --pages 65536 147456 278528 --out $OUT/auto-after > $OUT/auto-after.log 2>&1
grep -v "^|" $OUT/auto-after.log | cut -c1-210
python3 -m hybridkv_bench.compute_beside --device cuda --impls dma triton --priorities default high --pages 147456 --out $OUT/prio > $OUT/prio.log 2>&1
grep -v "^|" $OUT/prio.log | cut -c1-210
