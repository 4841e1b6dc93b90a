# issue 21 on the H200: the CUDA tests (stream order, cancelled load / store on CUDA) and the whole default suite
# with a GPU present (CUDA-parametrized cases included), tree = the commit printed in tree.txt
set -uo pipefail
. harness/campaign/gpu_env.sh || exit 1
export PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness:$PYTHONPATH
{ git rev-parse HEAD 2>/dev/null || echo "no git"; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; nproc; } > $OUT/tree.txt 2>&1
cat $OUT/tree.txt
# 1: every CUDA-marked test, verbose
timeout 240 python3 -m pytest -m cuda -v -p no:cacheprovider --junitxml=$OUT/cuda.xml \
  reference_impl/tests kernels/tests harness/tests --ignore=reference_impl/tests/vllm --ignore=reference_impl/tests/vllm_engine \
  > $OUT/cuda.log 2>&1; echo "cuda rc=$?"
tail -25 $OUT/cuda.log
# 2: the default suite (not slow) with the GPU visible, in parallel-free order
timeout 300 python3 -m pytest -m "not slow and not cuda" -q -p no:cacheprovider --junitxml=$OUT/suite.xml \
  reference_impl/tests kernels/tests harness/tests --ignore=reference_impl/tests/vllm --ignore=reference_impl/tests/vllm_engine \
  > $OUT/suite.log 2>&1; echo "suite rc=$?"
tail -30 $OUT/suite.log
