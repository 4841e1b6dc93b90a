# issue 21/24 on the H200, after the reshape: every CUDA test, then the default suite with the GPU visible
# (CUDA-parametrized cases included) in three parallel groups; the tree is the commit printed in tree.txt
set -uo pipefail
. harness/campaign/gpu_env.sh || exit 1
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness:$PYTHONPATH
{ cat .tree-commit 2>/dev/null || echo "no .tree-commit"; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; nproc; } > $OUT/tree.txt 2>&1
cat $OUT/tree.txt
IGN="--ignore=reference_impl/tests/vllm --ignore=reference_impl/tests/vllm_engine"
timeout 200 python3 -m pytest -m cuda -v -p no:cacheprovider --junitxml=$OUT/cuda.xml reference_impl/tests kernels/tests harness/tests $IGN \
  > $OUT/cuda.log 2>&1; echo "cuda rc=$?"; tail -3 $OUT/cuda.log
run() { timeout 420 python3 -m pytest -m "not slow and not cuda" -q -rf -p no:cacheprovider --junitxml=$OUT/suite-$1.xml "${@:2}" > $OUT/suite-$1.log 2>&1; echo "suite $1 rc=$?"; tail -4 $OUT/suite-$1.log; }
run server reference_impl/tests/server &
run engine reference_impl/tests/engine reference_impl/tests/test_structure.py kernels/tests &
run harness harness/tests &
wait
